"""What the training benchmarks share: a trainer's config on synthetic data,
and a trainer as a harness system (one chunk = `steps` training steps
through its own loader, as `recsys train` runs them)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from bench.harness import Size, SystemRun
from bench.record import Cell
from recsys_cli.config import TrainConfig
from recsys_cli.train.trainer import Trainer


@dataclass(frozen=True)
class TrainSize(Size):
    """The model, synthetic rows and their cardinalities (x Kaggle's), batch
    size and training steps per chunk."""

    model: str = "dlrm_kaggle"
    rows: int = 300_000
    scale: float = 1.0
    batch: int = 128
    steps: int = 50

    def total_steps(self) -> int:
        return (self.warmup + self.rounds) * self.steps


def train_config(size: TrainSize, threads: int | None = None, overrides: Mapping[str, Any] | None = None) -> Any:
    """A trainer's config: the size's model on its synthetic data, SGD lr 0.1
    (the schema's), no evaluation, no checkpoint, no progress bar; `threads`
    compute threads (default: torch's count); `overrides` (dotted keys) on top."""
    cfg = OmegaConf.structured(TrainConfig)
    OmegaConf.update(cfg, "model", OmegaConf.load(f"configs/model/{size.model}.yaml"), merge=True)
    cfg.dataset.synthetic.rows = size.rows
    cfg.dataset.synthetic.cardinality_scale = size.scale
    cfg.trainer.batch_size = size.batch
    cfg.trainer.max_steps = size.total_steps()
    cfg.trainer.progress = False
    cfg.trainer.eval_every = None
    cfg.trainer.checkpoint_every = None
    cfg.trainer.log_every = 10_000
    cfg.trainer.threads = threads if threads is not None else torch.get_num_threads()
    for key, value in (overrides or {}).items():
        OmegaConf.update(cfg, key, value, merge=True)
    return cfg


class TrainerRun(SystemRun):
    """recsys's trainer: each chunk trains `steps` steps end to end (its
    loader thread and, for lookahead, its prefetcher running), with the
    config's compute threads set for the chunk (they are a process-wide
    setting that the systems of one process share). With `evaluate`, the
    extras hold that split's AUC after the last round."""

    def __init__(self, cfg: Any, steps: int, evaluate: str | None = None) -> None:
        self.trainer = Trainer(cfg)
        self.evaluate = evaluate
        self.trainer.eval_loaders = {k: v for k, v in self.trainer.eval_loaders.items() if k == evaluate}
        self.steps, self.threads = steps, int(cfg.trainer.threads)
        self.batches: Iterator[Any] = self.trainer.epoch_batches()

    def chunk(self) -> int:
        torch.set_num_threads(self.threads)
        t, samples = self.trainer, 0
        for _ in range(self.steps):
            batch = next(self.batches, None)
            if batch is None:  # the epoch ended: the next one
                self.batches = t.epoch_batches()
                batch = next(self.batches)
            t.train_step(batch)
            t.feed.passed(t.step)
            samples += batch.size
        return samples

    def extras(self) -> Mapping[str, Cell]:
        out: dict[str, Cell] = {}
        if self.evaluate:
            out[f"{self.evaluate} AUC"] = float(self.trainer.evaluate(self.evaluate)["auc"])
        stats = self.trainer.embeddings.stats()
        if stats.get("hit_rate") is not None:
            out["hit rate"] = float(stats["hit_rate"])
            # The caches' own work a step (on lookahead's prefetch thread), waits for the trainer left out.
            out["fill work ms/step"] = 1000 * float(stats["prepare_seconds"]) / max(self.trainer.step, 1)
        memory = self.trainer.embeddings.memory()
        out["table+cache MiB"] = (memory["table"] + memory["cache"]) / 2**20
        out["index MiB"] = memory["index"] / 2**20
        return out

    def close(self) -> None:
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()
