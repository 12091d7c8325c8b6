"""Compute threads: steady-state training samples/s at each torch thread count.

    .venv/bin/python -m bench.threads_bench [--rows 200000] [--steps 300] [--rounds 3] [--record]

The evidence behind the default of train/threads.py (every core for a wide
step, else cores minus one per busy background thread). One process trains
short runs end to end through the loader (its thread shares the cores),
alternating the thread counts 1..cores in rounds, so a change in the
machine's load hits every count alike; each run's figure is the trainer's
steady state (train/throughput.py: after the warm-up, no evaluation, no
checkpoint). Two models: the default `make train`
model (dlrm_small, batch 256) and dlrm_kaggle at batch 2048 (wider MLPs,
where more threads have the most to give). Prints per-round figures, the
median per count and the ratio to the default rule's count.
"""

from __future__ import annotations

import argparse
import os
import statistics

from omegaconf import OmegaConf

from recsys_cli.config import TrainConfig
from recsys_cli.train.threads import available_cores, default_threads, matmul_macs_per_sample
from recsys_cli.train.trainer import Trainer

MODELS = {"dlrm_small": 256, "dlrm_kaggle": 2048}


def config(model: str, batch_size: int, rows: int, steps: int, threads: int) -> TrainConfig:
    cfg = OmegaConf.structured(TrainConfig)
    OmegaConf.update(cfg, "model", OmegaConf.load(f"configs/model/{model}.yaml"), merge=True)
    cfg.dataset.synthetic.rows = rows
    cfg.dataset.synthetic.cardinality_scale = 0.001  # the data its BENCHMARKS rows were measured on
    cfg.trainer.batch_size = batch_size
    cfg.trainer.max_steps = steps
    cfg.trainer.progress = False
    cfg.trainer.checkpoint_every = None  # no mid-run checkpoint pause (the schema's default is every 1000 steps)
    cfg.trainer.log_every = 10_000
    cfg.trainer.threads = threads
    return cfg


def steady_rate(cfg) -> float:
    trainer = Trainer(cfg)
    trainer.eval_loaders = {}  # throughput only
    return trainer.fit()["samples_per_second"]


def run(rows: int, steps: int, rounds: int) -> list[dict]:
    cores = available_cores()
    counts = list(range(1, cores + 1))
    out = []
    for model, batch in MODELS.items():
        model_steps = steps if batch <= 256 else max(20, steps // 8)
        step_macs = matmul_macs_per_sample(Trainer(config(model, batch, rows, model_steps, 1)).model) * batch
        rule = default_threads(cores, background=1, step_macs=step_macs)
        rates: dict[int, list[float]] = {n: [] for n in counts}
        for r in range(rounds):
            order = counts if r % 2 == 0 else counts[::-1]  # neither count always goes first
            for n in order:
                rates[n].append(steady_rate(config(model, batch, rows, model_steps, n)))
            print(f"{model} round {r + 1}: " + ", ".join(f"{n} threads {rates[n][-1]:,.0f}" for n in counts), flush=True)
        base = statistics.median(rates[rule])
        for n in counts:
            med = statistics.median(rates[n])
            out.append({"model": model, "batch": batch, "steps": model_steps, "threads": n,
                        "rule": "yes" if n == rule else "", "median samples/s": med,
                        "min": min(rates[n]), "max": max(rates[n]), "vs rule": med / base,
                        "load avg (1 min) at end": os.getloadavg()[0]})
            print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    rows = run(args.rows, args.steps, args.rounds)
    if args.record:
        from bench.record import record

        record("Compute threads: steady-state samples/s by torch thread count (loader thread running)",
               list(rows[0]), rows,
               f"python -m bench.threads_bench --rows {args.rows} --steps {args.steps} --rounds {args.rounds}",
               note="One process, thread counts alternated in rounds (median, min, max over rounds). 'rule': the "
                    "count trainer.threads defaults to (cores minus the loader thread). The load average says how "
                    "busy the shared machine was.")


if __name__ == "__main__":
    main()
