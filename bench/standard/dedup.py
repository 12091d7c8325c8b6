"""Dedup (RecD): training samples/s with deduplicated batches against without.

Synthetic sessions (mean 8 samples, 85 % of one-hot values repeat within a
session) with 3 multi-hot history features of 100-200 ids shared by a
session's samples, so embedding work dominates the step, as in RecD's
production models; dlrm_small, batch 512; both trainers in one process, in
alternating chunks. (The shard bytes of the session-clustered layout were
answered in earlier rows.)
"""

from __future__ import annotations

from typing import Any

from bench.harness import Benchmark, System, SystemRun
from bench.standard.common import TrainerRun, TrainSize, train_config

SESSIONS: dict[str, Any] = {
    "dataset.name": "synthetic_sessions", "dataset.synthetic.sessions": True,
    "dataset.synthetic.session_mean_length": 8.0, "dataset.synthetic.session_repeat": 0.85,
    "dataset.synthetic.multi_hot_features": 3, "dataset.synthetic.multi_hot_min_length": 100,
    "dataset.synthetic.multi_hot_max_length": 200,
}


def system(dedup: bool) -> System[TrainSize]:
    def build(size: TrainSize) -> SystemRun:
        return TrainerRun(train_config(size, overrides={**SESSIONS, "dedup.enabled": dedup}), size.steps)
    return System("dedup on" if dedup else "dedup off", build)


BENCHMARK = Benchmark[TrainSize](
    name="dedup",
    section="Dedup: training and loader throughput, dedup on vs off",
    sizes={
        "smoke": TrainSize(model="dlrm_small", rows=4_000, scale=0.001, batch=256, steps=2, rounds=2),
        "standard": TrainSize(model="dlrm_small", rows=200_000, scale=0.01, batch=512, steps=20, rounds=5),
    },
    systems=[system(False), system(True)],
    seconds=40,
)
