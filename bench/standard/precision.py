"""Precision (Yang et al.): int8/int4 tables behind an fp32 cache against fp32 tables.

dlrm_small on synthetic data (Kaggle profile x 0.01), batch 256, SGD, device
placement; every trainer built in one process and trained in alternating
chunks on the same batches, so after the last round each has trained the
same steps: its validation AUC, samples/s and embedding bytes side by side.
Goals: int8 within 0.001 AUC and int4 within 0.003 of fp32 with stochastic
rounding; table+cache >= 2.7x smaller for int8 + 5 %, >= 4.5x for int4 + 1 %.
"""

from __future__ import annotations

from bench.harness import Benchmark, System, SystemRun
from bench.standard.common import TrainerRun, TrainSize, train_config

# name: (precision, rounding, cache ratio)
PRECISIONS = {
    "fp32": ("fp32", None, None),
    "int8 stochastic + 5 %": ("int8", "stochastic", 0.05),
    "int8 nearest + 5 %": ("int8", "nearest", 0.05),
    "int4 stochastic + 1 %": ("int4", "stochastic", 0.01),
    "int4 nearest + 1 %": ("int4", "nearest", 0.01),
}


def system(name: str) -> System[TrainSize]:
    kind, rounding, ratio = PRECISIONS[name]

    def build(size: TrainSize) -> SystemRun:
        overrides: dict[str, object] = {"precision.kind": kind}
        if rounding is not None:
            overrides.update({"precision.rounding": rounding, "precision.cache_ratio": ratio})
        return TrainerRun(train_config(size, overrides=overrides), size.steps, evaluate="val")
    return System(name, build)


BENCHMARK = Benchmark[TrainSize](
    name="precision",
    section="Precision: AUC, speed and memory of int8/int4 tables behind an fp32 cache",
    note="Synthetic data (Kaggle profile x 0.01), dlrm_small, device placement. Goals: int8 within 0.001 AUC and "
         "int4 within 0.003 of fp32 with stochastic rounding.",
    sizes={
        "smoke": TrainSize(model="dlrm_small", rows=6_000, scale=0.001, batch=128, steps=2, rounds=2),
        "standard": TrainSize(model="dlrm_small", rows=1_000_000, scale=0.01, batch=256, steps=200, rounds=5),
    },
    systems=[system(n) for n in PRECISIONS],
    seconds=80,
)
