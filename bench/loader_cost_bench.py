"""What the loader thread costs a step at batch 128 (issue 30 item 2).

    .venv/bin/python -m bench.loader_cost_bench [--rows 300000] [--steps 600] [--rounds 2] [--record]

dlrm_kaggle on Kaggle cardinalities, device placement, SGD, one process.
Per compute-thread count (1 and 2), in rounds that alternate them:

  loader alone    the training loader with the trainer's transform (reading
                  parquet row groups, permuting, building the batch, planning
                  the lookups), iterated with nothing else running: its
                  batches/s, and the process CPU seconds per batch (the
                  loader thread's work: the consumer only takes batches)
  step alone      Trainer.train_step on batches already loaded and planned
  end to end      the trainer's steady state through its loader (the
                  loader thread shares the cores with the compute threads)

The loader sets the pace when end to end falls below step alone while the
loader alone keeps up with the step: then its work competes for the cores
rather than arriving late. `loader share` is the loader's CPU per batch over
the step-alone time per step (1.0: as long as a step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from omegaconf import OmegaConf

from recsys_cli.config import TrainConfig
from recsys_cli.train.trainer import Trainer


def config(rows: int, steps: int, threads: int) -> TrainConfig:
    cfg = OmegaConf.structured(TrainConfig)
    OmegaConf.update(cfg, "model", OmegaConf.load("configs/model/dlrm_kaggle.yaml"), merge=True)
    cfg.dataset.synthetic.rows = rows
    cfg.dataset.synthetic.cardinality_scale = 1.0
    cfg.trainer.batch_size = 128
    cfg.trainer.max_steps = steps
    cfg.trainer.progress = False
    cfg.trainer.checkpoint_every = None  # no mid-run checkpoint pause (the schema's default is every 1000 steps)
    cfg.trainer.log_every = 10_000
    cfg.trainer.threads = threads
    cfg.trainer.final_checkpoint = False
    return cfg


def measure(rows: int, steps: int, threads: int) -> dict:
    trainer = Trainer(config(rows, steps, threads))
    trainer.eval_loaders = {}  # throughput only
    torch.set_num_threads(threads)
    # loader alone: the consumer only counts
    batches = []
    cpu, wall = time.process_time(), time.perf_counter()
    for batch in trainer.train_loader:
        batches.append(batch)
        if len(batches) == steps:
            break
    loader_wall, loader_cpu = time.perf_counter() - wall, time.process_time() - cpu
    # step alone, on the batches just loaded (a warm-up first)
    for b in batches[:10]:
        trainer.train_step(b)
    wall = time.perf_counter()
    for b in batches[10:]:
        trainer.train_step(b)
    step_s = (time.perf_counter() - wall) / (len(batches) - 10)
    del batches, trainer
    end_to_end = Trainer(config(rows, steps, threads))
    end_to_end.eval_loaders = {}
    rate = end_to_end.fit()["samples_per_second"]
    return {"threads": threads, "loader alone batches/s": steps / loader_wall,
            "loader CPU ms/batch": 1e3 * loader_cpu / steps, "step alone ms": 1e3 * step_s,
            "step alone samples/s": 128 / step_s, "end to end samples/s": rate,
            "end to end / step alone": rate * step_s / 128, "loader share": loader_cpu / steps / step_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()
    by_threads: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for threads in (1, 2):
            row = measure(args.rows, args.steps, threads)
            print(row, flush=True)
            by_threads[threads].append(row)
    results = []
    for threads, rows in by_threads.items():
        median = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "threads"}
        results.append({"threads": threads, **median, "rounds": len(rows),
                        "load average": " ".join(f"{x:.1f}" for x in load)})
    for r in results:
        print(r)
    if args.record:
        from bench.record import record

        record("Loader cost at batch 128 (issue 30 item 2): loader alone, step alone, end to end",
               list(results[0]), results, "python -m bench.loader_cost_bench " + " ".join(__import__("sys").argv[1:]),
               note="dlrm_kaggle, Kaggle cardinalities, device placement, batch 128, one process; medians over "
                    "rounds alternating the compute-thread count. loader share: the loader thread's CPU per "
                    "batch over the step-alone time.")


if __name__ == "__main__":
    main()
