"""Model quality: test AUC, log loss and normalized entropy over seeds.

Every system trains the Criteo Kaggle reference architecture (dlrm_kaggle:
16-dim tables, bottom 13-512-256-64-16, top 512-256-1) with SGD lr 0.1 at
batch 128, the reference's settings, on the same data, changing one thing at
a time against the first system. One chunk is one whole training run (one
epoch, its final test evaluation) with the round's seed: round r trains
every system with seed r, so a run cut short by its time share still
compares like with like. "AUC vs first" is the mean over seeds of the
per-seed test AUC difference to the first system (paired: same data, same
seed). One compute thread: on a shared 2-core machine two threads wait on
each other at every op.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from bench.harness import Benchmark, Size, System, SystemRun
from bench.record import Cell
from recsys_cli.config import TrainConfig
from recsys_cli.train.trainer import Trainer

SYSTEMS: dict[str, dict[str, Any]] = {
    "dot, dlrm init": {},
    "dot, torch init": {"model.init": "torch"},
    "dcn, dlrm init": {"model.interaction": "dcn", "model.dcn_layers": 3, "model.dcn_rank": 64},
    "int8 + 5 % cache": {"precision.kind": "int8", "precision.cache_ratio": 0.05},
    "int4 + 1 % cache": {"precision.kind": "int4", "precision.cache_ratio": 0.01},
    "lookahead 5 %": {"placement.kind": "lookahead", "placement.cache_ratio": 0.05},
}
FIRST = next(iter(SYSTEMS))


@dataclass(frozen=True)
class QualitySize(Size):
    rows: int = 100_000
    scale: float = 0.001
    epochs: int = 1
    threads: int = 1


class QualityRun(SystemRun):
    # Each system's per-seed test AUCs, for the paired difference to the first
    # system (whose extras are read first: it is built and reported first).
    aucs: dict[str, list[float]] = {}

    def __init__(self, name: str, size: QualitySize) -> None:
        self.name, self.size = name, size
        self.tests: list[dict[str, float]] = []
        QualityRun.aucs[name] = []

    def config(self, seed: int) -> Any:
        cfg = OmegaConf.structured(TrainConfig)
        OmegaConf.update(cfg, "model", OmegaConf.load("configs/model/dlrm_kaggle.yaml"), merge=True)
        cfg.dataset.synthetic.rows = self.size.rows
        cfg.dataset.synthetic.cardinality_scale = self.size.scale
        cfg.optimizer.name, cfg.optimizer.lr = "sgd", 0.1
        cfg.trainer.batch_size, cfg.trainer.epochs, cfg.trainer.seed = 128, self.size.epochs, seed
        cfg.trainer.threads = self.size.threads
        cfg.trainer.progress, cfg.trainer.checkpoint_every, cfg.trainer.log_every = False, None, 1_000_000
        for key, value in SYSTEMS[self.name].items():
            OmegaConf.update(cfg, key, value)
        return cfg

    def chunk(self) -> int:
        torch.set_num_threads(self.size.threads)
        summary = Trainer(self.config(seed=len(self.tests))).fit()
        test = summary["final"].get("test") or summary["final"]["val"]
        self.tests.append({"auc": test["auc"], "logloss": test["logloss"], "ne": test["normalized_entropy"],
                           "calibration": test["calibration"]})
        QualityRun.aucs[self.name].append(test["auc"])
        return int(summary["steps"]) * 128

    def extras(self) -> Mapping[str, Cell]:
        aucs = QualityRun.aucs[self.name]
        paired = [a - f for a, f in zip(aucs, QualityRun.aucs[FIRST])]
        return {"test AUC": mean_sd(aucs), "AUC vs first": f"{statistics.fmean(paired):+.4f}",
                "log loss": mean_sd([t["logloss"] for t in self.tests]), "NE": mean_sd([t["ne"] for t in self.tests]),
                "calibration": f"{statistics.fmean(t['calibration'] for t in self.tests):.3f}",
                "AUC per seed": " ".join(f"{a:.4f}" for a in aucs)}


def mean_sd(values: list[float], digits: int = 4) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


def system(name: str) -> System[QualitySize]:
    return System(name, lambda size: QualityRun(name, size))


BENCHMARK = Benchmark[QualitySize](
    name="quality",
    section="Quality: test AUC, log loss and NE over seeds (dlrm_kaggle, SGD lr 0.1, batch 128)",
    note="Each round one seed, every system: mean ± sample sd over seeds; 'AUC vs first' paired by seed.",
    sizes={
        "smoke": QualitySize(rows=3_000, rounds=2, warmup=0),
        "standard": QualitySize(rows=60_000, rounds=3, warmup=0),
        "long": QualitySize(rows=100_000, rounds=5, warmup=0),
    },
    systems=[system(n) for n in SYSTEMS],
    seconds=70,
)
