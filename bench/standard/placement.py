"""Placement (cDLRM): lookahead caches and host tables against device placement.

dlrm_kaggle on synthetic data with Kaggle's cardinalities (33.8M rows at
scale 1), batch 1024, SGD; every trainer built in one process, trained in
alternating chunks through its own loader. Goal on CPU: lookahead at 5 %
cache >= 0.9x device, at 1 % >= 0.75x. (The window and cache-size sweep and
the on-demand cache's hit rates by policy were answered in earlier rows.)
"""

from __future__ import annotations

from typing import Any

from bench.harness import Benchmark, System, SystemRun
from bench.standard.common import TrainerRun, TrainSize, train_config

PLACEMENTS: dict[str, dict[str, Any]] = {
    "device": {"kind": "device"},
    "lookahead 5 %": {"kind": "lookahead", "cache_ratio": 0.05, "window": 4},
    "lookahead 1 %": {"kind": "lookahead", "cache_ratio": 0.01, "window": 4},
    "host": {"kind": "host"},
}


def placed(placement: dict[str, Any]) -> System[TrainSize]:
    def build(size: TrainSize) -> SystemRun:
        return TrainerRun(train_config(size, overrides={"placement": placement}), size.steps)
    return System(next(n for n, p in PLACEMENTS.items() if p is placement), build)


BENCHMARK = Benchmark[TrainSize](
    name="placement",
    section="Placement: lookahead vs device (dlrm_kaggle, Kaggle cardinalities)",
    note="Goal on CPU: lookahead at 5 % cache >= 0.9x device, at 1 % >= 0.75x.",
    sizes={
        "smoke": TrainSize(rows=8_000, scale=0.001, batch=256, steps=2, rounds=2),
        "standard": TrainSize(rows=400_000, scale=1.0, batch=1024, steps=20, rounds=5),
    },
    systems=[placed(p) for p in PLACEMENTS.values()],
    seconds=80,
)
