"""Peak memory (issue 18): fp32 device tables against int8 / int4 behind a lookahead cache.

dlrm_kaggle on Kaggle cardinalities (33.8M rows; 2.0 GiB of fp32 tables at
dim 16), SGD, batch 128, CPU, no checkpoint. Each system trains in its own
process, so the row's peak RSS is that process's own high-water mark
(VmHWM), beside the bytes its embedding tensors hold (tables + cache, and the
cache's index). Ratios are over fp32's peak in the same benchmark run.
"""

from __future__ import annotations

from bench.harness import Benchmark, System, SystemRun
from bench.standard.common import TrainerRun, TrainSize, train_config

SYSTEMS: dict[str, dict[str, object]] = {
    "fp32 device": {},
    "int8 + 5 % lookahead": {"precision.kind": "int8", "placement": {"kind": "lookahead", "cache_ratio": 0.05}},
    "int4 + 1 % lookahead": {"precision.kind": "int4", "placement": {"kind": "lookahead", "cache_ratio": 0.01}},
}


def system(name: str) -> System[TrainSize]:
    def build(size: TrainSize) -> SystemRun:
        return TrainerRun(train_config(size, overrides=SYSTEMS[name]), size.steps)
    return System(name, build)


BENCHMARK = Benchmark[TrainSize](
    name="memory",
    section="Peak memory (issue 18): fp32 device vs int8 / int4 behind a lookahead cache (dlrm_kaggle)",
    note="Each system in its own process: peak RSS is its VmHWM. Ratios over fp32's peak in the same run.",
    sizes={
        "smoke": TrainSize(rows=4_000, scale=0.001, batch=128, steps=2, rounds=2),
        "standard": TrainSize(rows=300_000, scale=1.0, batch=128, steps=50, rounds=4),
    },
    systems=[system(n) for n in SYSTEMS],
    isolated=True,
    seconds=50,
)
