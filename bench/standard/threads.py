"""Compute threads: steady-state training samples/s at each torch thread count.

The evidence behind train/threads.py's default (every core for a wide step,
else cores minus one per busy background thread): one trainer per thread
count, built in one process and trained in alternating chunks through its
loader (whose thread shares the cores); the "default" column marks the count
the rule picks. Sizes: the default `make train` model (dlrm_small, batch
256) as "standard", dlrm_kaggle at batch 2048 (wider MLPs, where more threads
have the most to give) as "kaggle2048".
"""

from __future__ import annotations

from collections.abc import Mapping

from bench.harness import Benchmark, System, SystemRun
from bench.record import Cell
from bench.standard.common import TrainerRun, TrainSize, train_config
from recsys_cli.train.threads import available_cores, default_threads, matmul_macs_per_sample


class ThreadsRun(TrainerRun):
    def extras(self) -> Mapping[str, Cell]:
        step_macs = matmul_macs_per_sample(self.trainer.model) * self.trainer.cfg.trainer.batch_size
        rule = default_threads(available_cores(), background=1, step_macs=step_macs)
        return {"default": "yes" if rule == self.threads else ""}


def system(threads: int) -> System[TrainSize]:
    def build(size: TrainSize) -> SystemRun:
        return ThreadsRun(train_config(size, threads=threads), size.steps)
    return System(f"{threads} threads", build)


BENCHMARK = Benchmark[TrainSize](
    name="threads",
    section="Compute threads: steady-state samples/s by torch thread count (loader thread running)",
    note="One process, thread counts alternated in rounds. 'default': the count trainer.threads defaults to.",
    sizes={
        "smoke": TrainSize(model="dlrm_small", rows=4_000, scale=0.001, batch=128, steps=2, rounds=2),
        "standard": TrainSize(model="dlrm_small", rows=200_000, scale=0.001, batch=256, steps=60, rounds=5),
        "kaggle2048": TrainSize(model="dlrm_kaggle", rows=200_000, scale=0.001, batch=2048, steps=8, rounds=5),
    },
    systems=[system(n) for n in range(1, available_cores() + 1)],
    seconds=40,
)
