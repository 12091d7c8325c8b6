"""The dense half's speed options against the exact fp32 path, on the same run (BENCHMARKS.md).

    .venv/bin/python -m bench.peers.dense_options [--batch 256] [--rows 200000]

Variants: fp32 (the default, exact), fp32 + model.compile=true, bf16
(model.dense_precision=bf16) and bf16 + compile. Each is a recsys Trainer on
the same data with the same seed; they train one epoch on the same loader
batches in alternating chunks (one compute thread), so each chunk's
samples/s ratio to fp32 shares the machine's load. Then every variant
scores the validation split: the AUC cost of bf16 (and of compile, whose
reordered sums are not bit-exact) is measured on the same run. fp32 and bf16
are reported side by side, never merged into one figure. Needs only the
project's venv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.peers.systems import Recsys, Setup, dataset_dir, shapes_of

VARIANTS = {
    "fp32": (),
    "fp32+compile": ("model.compile=true",),
    "bf16": ("model.dense_precision=bf16",),
    "bf16+compile": ("model.dense_precision=bf16", "model.compile=true"),
}


def run(batch: int, rows: int, scale: float, chunk_steps: int, variants: list[str]) -> list[dict]:
    torch.set_num_threads(1)
    systems, startup = {}, {}
    for name in variants:
        setup = Setup(rows=rows, cardinality_scale=scale, batch_size=batch, overrides=VARIANTS[name])
        cfg = setup.config()
        cfg.trainer.eval_batch_size = 4096
        data = dataset_dir(cfg)
        systems[name] = Recsys(setup, shapes_of(cfg, data), data, cfg)
    batches = {n: iter(s.loader()) for n, s in systems.items()}
    steps_total = systems[variants[0]].trainer.train_loader.num_batches
    for n, s in systems.items():  # first step: compiles where compiling
        start = time.perf_counter()
        s.step(next(batches[n]))
        startup[n] = time.perf_counter() - start
    rates: dict[str, list[float]] = {n: [] for n in variants}
    done, load = 1, [os.getloadavg()[0]]
    while done < steps_total:
        steps = min(chunk_steps, steps_total - done)
        for n in variants:
            start = time.thread_time()
            for _ in range(steps):
                systems[n].step(next(batches[n]))
            rates[n].append(steps * batch / (time.thread_time() - start))
        done += steps
        load.append(os.getloadavg()[0])
    out = []
    for n in variants:
        auc = systems[n].trainer.evaluate("val")["auc"]
        ratios = [a / b for a, b in zip(rates[n], rates["fp32"])]
        out.append({"variant": n, "batch": batch, "steps": steps_total,
                    "samples/s (CPU time)": statistics.median(rates[n]),
                    "vs fp32 median (range)": f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                    "first step s": startup[n], "val AUC": auc,
                    "AUC - fp32": None, "load avg": f"{min(load):.1f}-{max(load):.1f}"})
    base = next(r["val AUC"] for r in out if r["variant"] == "fp32")
    for r in out:
        r["AUC - fp32"] = r["val AUC"] - base
        print(r, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--cardinality-scale", type=float, default=0.05)
    p.add_argument("--chunk-steps", type=int, default=25)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--record", action="store_true")
    args = p.parse_args()
    if args.variants[0] != "fp32":
        args.variants = ["fp32", *[v for v in args.variants if v != "fp32"]]
    rows = run(args.batch, args.rows, args.cardinality_scale, args.chunk_steps, args.variants)
    if args.record:
        from bench.record import record

        record("Dense speed options: fp32 vs torch.compile vs bf16 MLPs (dlrm_kaggle, one compute thread, same run)",
               list(rows[0]), rows,
               f"python -m bench.peers.dense_options --batch {args.batch} --rows {args.rows} "
               f"--cardinality-scale {args.cardinality_scale} --record",
               note=("One epoch of synthetic data per variant, trained in alternating chunks on the same batches; "
                     "samples/s on the compute thread's CPU time (the machine is shared: load average column), "
                     "ratio to fp32 per chunk; then validation AUC of each. fp32 is the exact default; compile "
                     "reorders sums (close, not bit-exact); bf16 runs the MLPs in bf16 autocast. "
                     "'first step s' includes compiling."))


if __name__ == "__main__":
    main()
