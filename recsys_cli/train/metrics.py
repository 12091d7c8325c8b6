"""Evaluation metrics, phase timing and the JSON-lines metrics log."""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC over all samples (Mann-Whitney U, tied scores share their
    average rank). nan when only one class is present."""
    scores = scores.double().flatten()
    labels = labels.flatten() > 0.5
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    _, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg_rank = ends - (counts.double() - 1) / 2  # 1-based average rank of each tie group
    ranks = torch.repeat_interleave(avg_rank, counts)
    rank_sum_pos = ranks[labels[order]].sum().item()
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    logits, labels = logits.double(), labels.double()
    logloss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).item()
    accuracy = ((logits > 0).double() == labels).double().mean().item()
    return {"auc": roc_auc(logits, labels), "logloss": logloss, "accuracy": accuracy, "samples": labels.numel()}


class PhaseTimer:
    """Wall seconds per phase of the step. On CUDA the device is synchronised
    at phase edges, so the split is honest (and costs a little throughput)."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.sync = device.type == "cuda"

    @contextmanager
    def phase(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - start


class MetricsLog:
    """metrics.jsonl in the run directory: one JSON object a line, flushed."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file = open(path, "a") if path is not None else None

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(_plain(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    return x


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_plain(obj), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
