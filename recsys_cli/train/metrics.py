"""Evaluation metrics, phase timing and the JSON-lines metrics log."""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from data_tools.metrics import roc_auc
from recsys_cli.errors import write_error

_PROB_EPS = 1e-15  # probabilities are clipped to [eps, 1 - eps] so one certain mistake costs 34.5, not inf


# Rows per float64 temporary of the metrics below: 2 MiB each, not a split's
# worth (a Kaggle-sized split has 3.3M rows, 26 MB per float64 copy).
_CHUNK_ROWS = 1 << 18


def _chunks(*columns) -> Iterator[tuple[torch.Tensor, ...]]:
    """The columns' rows _CHUNK_ROWS at a time, each chunk as float64, in row
    order: sums over them are a fixed sequence of additions for any split."""
    flat = [torch.as_tensor(c).detach().flatten().cpu() for c in columns]
    for lo in range(0, flat[0].numel(), _CHUNK_ROWS):
        yield tuple(c[lo:lo + _CHUNK_ROWS].double() for c in flat)


def _log_loss_sum(y: torch.Tensor, p: torch.Tensor) -> float:
    """Sum of the binary cross-entropy of float64 labels and probabilities."""
    p = p.clamp(_PROB_EPS, 1 - _PROB_EPS)
    # The products and sum of -(y * log(p) + (1 - y) * log1p(-p)), in place.
    positive = torch.log(p).mul_(y)
    negative = torch.log1p(p.neg_()).mul_(1 - y)
    return -positive.add_(negative).sum().item()


def _mean(x) -> float:
    return sum(c.sum().item() for c, in _chunks(x)) / torch.as_tensor(x).numel()


def log_loss(labels, probs) -> float:
    """Mean binary cross-entropy of predicted click probabilities."""
    return sum(_log_loss_sum(y, p) for y, p in _chunks(labels, probs)) / torch.as_tensor(labels).numel()


def binary_entropy(rate: float) -> float:
    """Entropy (nats) of a Bernoulli(rate): the log loss of always predicting
    the rate itself."""
    if not 0 < rate < 1:
        return float("nan")
    return -(rate * math.log(rate) + (1 - rate) * math.log1p(-rate))


def normalized_entropy(labels, probs) -> float:
    """Log loss divided by the entropy of the observed click rate (He et al.,
    "Practical lessons from predicting clicks on ads at Facebook", 2014):
    1.0 is no better than predicting the base rate, lower is better. nan when
    the labels hold one class only."""
    return log_loss(labels, probs) / binary_entropy(_mean(labels))


def _calibration(predicted: float, observed: float) -> float:
    return predicted / observed if observed > 0 else float("nan")


def calibration(labels, probs) -> float:
    """Mean predicted click probability over the observed click rate (He et
    al. 2014): 1.0 is calibrated, above 1 over-predicts. nan without clicks."""
    return _calibration(_mean(probs), _mean(labels))


class SplitPredictions:
    """A split's logits and labels, batch by batch, into two tensors allocated
    once for `rows` (at least the split's rows).

    Not a list of per-batch tensors: keeping one small tensor per batch,
    allocated between that batch's megabytes of temporaries, stops glibc's
    heap from reusing or returning the space around it, and the process grew
    by about 4 MB per 4096-row batch (6.5 GB for the Kaggle-sized validation
    and test splits of the headline run, BENCHMARKS.md), while the
    predictions themselves are 8 bytes a row."""

    def __init__(self, rows: int) -> None:
        self.logits = torch.empty(rows, dtype=torch.float32)
        self.labels = torch.empty(rows, dtype=torch.float32)
        self.rows = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        n = logits.numel()
        if self.rows + n > self.logits.numel():
            raise RuntimeError(f"{self.rows + n} predictions for a split of {self.logits.numel()} rows")
        self.logits[self.rows:self.rows + n].copy_(logits.reshape(-1))  # from the device, if there
        self.labels[self.rows:self.rows + n].copy_(labels.reshape(-1))
        self.rows += n

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logits[:self.rows], self.labels[:self.rows]


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Evaluation of a split: AUC, log loss, normalized entropy, accuracy, and
    calibration (mean predicted CTR beside the observed CTR). One pass over
    the rows in float64 chunks: the same sums as log_loss(), calibration()
    and normalized_entropy() of sigmoid(logits), with a working set of a few
    chunks, not of several float64 copies of the split."""
    n = torch.as_tensor(labels).numel()
    predicted = clicks = loss = correct = 0.0
    for z, y in _chunks(logits, labels):
        p = torch.sigmoid(z)
        predicted += p.sum().item()
        clicks += y.sum().item()
        loss += _log_loss_sum(y, p)
        correct += ((z > 0).double() == y).sum().item()
    predicted, observed, loss = predicted / n, clicks / n, loss / n
    return {
        "auc": roc_auc(torch.as_tensor(logits).detach().cpu().numpy(), torch.as_tensor(labels).detach().cpu().numpy()),
        "logloss": loss,
        "normalized_entropy": loss / binary_entropy(observed),
        "accuracy": correct / n,
        "predicted_ctr": predicted,
        "observed_ctr": observed,
        "calibration": _calibration(predicted, observed),
        "samples": n,
    }


def calibration_bins(labels, probs, bins: int = 10) -> list[dict]:
    """Predicted vs observed click rate in `bins` equal-width bins of the
    predicted probability: per bin its range, rows, mean prediction and
    observed rate (None for an empty bin). Counted chunk by chunk."""
    count = torch.zeros(bins, dtype=torch.int64)
    pred, obs = torch.zeros(bins, dtype=torch.float64), torch.zeros(bins, dtype=torch.float64)
    for y, p in _chunks(labels, probs):
        which = (p * bins).long().clamp_(0, bins - 1)
        count += torch.bincount(which, minlength=bins)
        pred += torch.bincount(which, weights=p, minlength=bins)
        obs += torch.bincount(which, weights=y, minlength=bins)
    return [{"lo": i / bins, "hi": (i + 1) / bins, "rows": int(count[i]),
             "predicted": (pred[i] / count[i]).item() if count[i] else None,
             "observed": (obs[i] / count[i]).item() if count[i] else None} for i in range(bins)]


def roc_curve(scores, labels, points: int = 1001) -> dict[str, list[float]]:
    """False and true positive rates at every distinct threshold (tied scores
    move together), thinned to about `points` points for plotting. Float
    scores are sorted as they are (as roc_auc does), and the rates come from
    integer counts at the tie groups' ends, not from float64 copies of the split."""
    s = torch.as_tensor(scores).detach().flatten().cpu()
    if not s.is_floating_point():
        s = s.double()
    y = torch.as_tensor(labels).detach().flatten().cpu() > 0.5
    order = torch.argsort(s, descending=True)
    s, y = s[order], y[order]
    del order
    last = torch.ones(len(s), dtype=torch.bool)
    if len(s) > 1:
        last[:-1] = s[1:] != s[:-1]  # the last row of each tie group
    del s
    ends = torch.nonzero(last).flatten()
    zero = torch.zeros(1, dtype=torch.int64)
    tp = torch.cat([zero, torch.cumsum(y, 0)[ends]])  # positives at or above each threshold
    fp = torch.cat([zero, ends + 1]) - tp
    tpr, fpr = tp.double() / max(tp[-1].item(), 1), fp.double() / max(fp[-1].item(), 1)
    if len(tpr) > points:
        keep = torch.unique(torch.linspace(0, len(tpr) - 1, points).round().long())
        tpr, fpr = tpr[keep], fpr[keep]
    return {"fpr": fpr.tolist(), "tpr": tpr.tolist()}


class PhaseTimer:
    """Seconds per phase of the step, from events recorded at the phase edges
    on the compute stream and read later (collect(), at log time): on CUDA a
    phase is the device time between its edges, and nothing waits for the
    device while the step runs, so the prefetch side stream keeps
    overlapping compute (a torch.cuda.synchronize() per edge would drain it).
    A host phase such as data_wait measures how long the device sat idle
    waiting for the host. On CPU the events are the host clock."""

    def __init__(self, device: torch.device, runtime=None) -> None:
        from recsys_cli.device import runtime_for

        self.runtime = runtime or runtime_for(device)
        self._seconds: dict[str, float] = defaultdict(float)
        self._pending: list[tuple[str, Any, Any]] = []  # (phase, start, end): the runtime's events

    @contextmanager
    def phase(self, name: str):
        stream = self.runtime.current_stream()
        start = self.runtime.event(timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end = self.runtime.event(timing=True)
            end.record(stream)
            self._pending.append((name, start, end))

    def collect(self) -> None:
        """Add up the phases recorded so far (waits for the last one's end)."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()  # the stream is in order: every earlier event is done too
        for name, start, end in self._pending:
            self._seconds[name] += start.elapsed_time(end) / 1000.0
        self._pending.clear()

    @property
    def seconds(self) -> dict[str, float]:
        self.collect()
        return self._seconds


class MetricsLog:
    """metrics.jsonl in the run directory: one JSON object a line, written
    whole or not at all. `lines` is everything written so far; a checkpoint
    keeps it, so that a resumed run cuts the file back to the checkpoint
    (`restore`) and ends with the file an uninterrupted run writes."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lines: list[str] = []
        self._fd: int | None = None
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as e:
                raise write_error(path, e) from None

    def write(self, record: dict) -> None:
        line = json.dumps(_plain(record)) + "\n"
        self.lines.append(line)
        if self._fd is None or self.path is None:  # both or neither
            return
        size = os.fstat(self._fd).st_size
        try:
            data = line.encode()
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as e:
            try:  # no half line: cut back to the last whole record
                os.ftruncate(self._fd, size)
            except OSError:
                pass
            raise write_error(self.path, e) from None

    def restore(self, lines: list[str]) -> None:
        """Replace the file (atomically) by `lines`: the records up to a checkpoint."""
        self.lines = list(lines)
        if self.path is None:
            return
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "w") as f:
                f.writelines(self.lines)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise write_error(self.path, e) from None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
    try:
        with open(tmp, "w") as f:
            json.dump(_plain(obj), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(path, e) from None
