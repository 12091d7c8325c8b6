"""Multi-process training: throughput, communication, and cache_avg's drift.

Every run is started the way `recsys train trainer.nproc=N` starts it
(distributed.launch: torch's elastic launcher, gloo on CPU) on synthetic data
with the small DLRM, global batch 256, SGD lr 0.1, one compute thread per
process. Runs are deterministic, so one round gives the AUC and the drift;
the standard size's 300 steps keep the 7 launches near two minutes. One chunk is one whole launched run (so the harness's rate counts
the launch; "trainer samples/s" is the trainer's own steady state). Systems:
1 and 2 processes, device and lookahead placement, embedding_sync=grad; and
embedding_sync=cache_avg with sync_every 1, 10, 100 on 2 processes, whose
drift is the largest difference of a weight (dense parameters and every
table row) from the 2-process grad-sync run's, relative to the largest
magnitude in its tensor. "early syncs": syncs rank 0's prefetcher asked for
because only rows touched since the last sync could free cache slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from bench.harness import Benchmark, Size, System, SystemRun
from bench.record import Cell
from recsys_cli.config import TrainConfig
from recsys_cli.train import distributed
from recsys_cli.train.trainer import Trainer

REFERENCE = "lookahead x2 grad"  # the drift's reference


@dataclass(frozen=True)
class DistributedSize(Size):
    rows: int = 300_000
    steps: int = 400
    cache_ratio: float = 0.05


@dataclass(frozen=True)
class Run:
    placement: str
    processes: int
    sync: str = "grad"
    every: int = 1

    @property
    def name(self) -> str:
        return f"{self.placement} x{self.processes} {self.sync}" + (f" k={self.every}" if self.sync == "cache_avg" else "")


RUNS = [Run("device", 1), Run("device", 2), Run("lookahead", 1), Run("lookahead", 2),
        Run("lookahead", 2, "cache_avg", 1), Run("lookahead", 2, "cache_avg", 10), Run("lookahead", 2, "cache_avg", 100)]


def config(size: DistributedSize, run: Run) -> dict[str, Any]:
    cfg = OmegaConf.structured(TrainConfig)
    cfg.dataset.synthetic.rows = size.rows
    cfg.dataset.synthetic.cardinality_scale = 0.002
    cfg.trainer.batch_size, cfg.trainer.max_steps = 256, size.steps
    cfg.trainer.log_every, cfg.trainer.progress, cfg.trainer.checkpoint_every = 50, False, None
    cfg.placement.kind, cfg.placement.cache_ratio = run.placement, size.cache_ratio
    cfg.trainer.embedding_sync, cfg.trainer.sync_every = run.sync, run.every
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items()}


def bench_worker(container: dict[str, Any], threads: int) -> dict[str, Any] | None:
    """One rank: train, and (rank 0) return the numbers and the final weights."""
    ctx = distributed.init(timeout_s=300, device="cpu")
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), container)
    cfg.trainer.threads = threads  # the trainer sets torch's threads while it trains
    trainer = Trainer(cfg)
    summary = trainer.fit()  # ends with an evaluation, which syncs cache_avg's replicas
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    for i, g in enumerate(trainer.embeddings.groups):
        weights[f"group{i:03d}"] = g.read(torch.arange(g.num_rows)).clone()
    distributed.teardown()
    if not ctx.is_main:
        return None
    dist = summary.get("distributed") or {}
    return {"samples_per_second": summary["samples_per_second"],
            "comm_per_step": summary["phase_seconds"]["communication"] / summary["steps"],
            "val_auc": summary["final"]["val"]["auc"], "syncs": dist.get("syncs"), "early_syncs": dist.get("early_syncs"),
            "weights": [weights[k] for k in sorted(weights, key=lambda k: (k.startswith("group"), k))]}


def drift(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))


class LaunchedRun(SystemRun):
    weights: dict[str, list[torch.Tensor]] = {}  # each system's final weights, for the drift

    def __init__(self, run: Run, size: DistributedSize) -> None:
        self.run, self.size = run, size
        self.out: dict[str, Any] = {}

    def chunk(self) -> int:
        self.out = distributed.launch(bench_worker, self.run.processes, config(self.size, self.run), 1)[0]
        LaunchedRun.weights[self.run.name] = self.out["weights"]
        return self.size.steps * 256

    def extras(self) -> Mapping[str, Cell]:
        out = self.out
        reference = LaunchedRun.weights.get(REFERENCE)
        return {"trainer samples/s": out["samples_per_second"], "comm ms/step": out["comm_per_step"] * 1000,
                "val AUC": out["val_auc"], "syncs": out["syncs"], "early syncs": out["early_syncs"],
                "drift vs grad": (drift(out["weights"], reference) if self.run.sync == "cache_avg" and reference
                                  else None)}


def system(run: Run) -> System[DistributedSize]:
    return System(run.name, lambda size: LaunchedRun(run, size))


BENCHMARK = Benchmark[DistributedSize](
    name="distributed",
    section="Multi-process training",
    note="gloo on CPU via the elastic launcher; drift: largest weight difference from the 2-process grad-sync run, "
         "relative to its tensor's largest magnitude.",
    sizes={
        "smoke": DistributedSize(rows=4_000, steps=4, rounds=1, warmup=0),
        "standard": DistributedSize(rows=300_000, steps=300, rounds=1, warmup=0),
    },
    systems=[system(r) for r in RUNS],
    seconds=60,
)
