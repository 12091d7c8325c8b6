"""Multi-process training: throughput, communication, and cache_avg's drift.

    .venv/bin/python -m bench.distributed_bench [--rows 300000] [--steps 400] [--quick] [--record]

Every run is started the way `recsys train trainer.nproc=N` starts it
(distributed.launch: torch's elastic launcher, gloo on CPU) on the built-in
synthetic data with the small DLRM, global batch 256, SGD lr 0.1:

* samples/s and communication seconds per step (the gradient all-reduce and
  cache syncs, timed on rank 0's main thread) for 1 and 2 processes, device
  and lookahead placement, trainer.embedding_sync=grad;
* val AUC and drift for trainer.embedding_sync=cache_avg with sync_every
  1, 10, 100 on 2 processes: drift is the largest difference of a weight
  (dense parameters and every table row) from the grad-sync run's, relative
  to the largest magnitude in its tensor. "early syncs" are the ones rank 0's
  prefetcher asked for because only rows touched since the last sync could
  free cache slots: with a small cache they, not sync_every, set the pace.

Each process uses --threads torch threads (default 1: one process per core,
the CPU analogue of one process per device). On a 2-core machine the loader
and prefetcher threads share those cores too, so 2 processes cannot double
the samples/s; the communication column is the price of the sync.
"""

from __future__ import annotations

import argparse
import time

import torch
from omegaconf import OmegaConf

from recsys_cli.config import TrainConfig
from recsys_cli.train import distributed
from recsys_cli.train.trainer import Trainer
from recsys_cli.train.training_data import resolve_dataset


def make_config(rows: int, steps: int, placement: str, sync: str = "grad", every: int = 1,
                cache_ratio: float = 0.05) -> dict:
    cfg = OmegaConf.structured(TrainConfig)
    cfg.dataset.synthetic.rows = rows
    cfg.dataset.synthetic.cardinality_scale = 0.002
    cfg.trainer.batch_size = 256
    cfg.trainer.max_steps = steps
    cfg.trainer.log_every = 50
    cfg.trainer.progress = False
    cfg.trainer.checkpoint_every = None  # no mid-run checkpoint pause (the schema's default is every 1000 steps)
    cfg.placement.kind = placement
    cfg.placement.cache_ratio = cache_ratio
    cfg.trainer.embedding_sync = sync
    cfg.trainer.sync_every = every
    return OmegaConf.to_container(cfg, resolve=True)


def bench_worker(container: dict, threads: int) -> dict | None:
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
    return {
        "samples_per_second": summary["samples_per_second"],
        "comm_per_step": summary["phase_seconds"]["communication"] / summary["steps"],
        "val_auc": summary["final"]["val"]["auc"],
        "syncs": (summary.get("distributed") or {}).get("syncs"),
        "early_syncs": (summary.get("distributed") or {}).get("early_syncs"),
        "weights": [weights[k] for k in sorted(weights, key=_order)],
    }


def _order(key: str):
    return (key.startswith("group"), key)


def drift(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--cache-ratio", type=float, default=0.05, help="lookahead cache size, share of rows")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (one process per core)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 50k rows, 60 steps")
    parser.add_argument("--record", action="store_true", help="append the rows to BENCHMARKS.md")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.steps = 50_000, 60
    resolve_dataset(OmegaConf.create(make_config(args.rows, 1, "device"))["dataset"])  # generate once

    runs = [
        ("device", 1, "grad", 1), ("device", 2, "grad", 1),
        ("lookahead", 1, "grad", 1), ("lookahead", 2, "grad", 1),
        ("lookahead", 2, "cache_avg", 1), ("lookahead", 2, "cache_avg", 10), ("lookahead", 2, "cache_avg", 100),
    ]
    results = []
    for placement, nproc, sync, every in runs:
        start = time.perf_counter()
        config = make_config(args.rows, args.steps, placement, sync, every, args.cache_ratio)
        out = distributed.launch(bench_worker, nproc, config, args.threads)[0]
        print(f"  {placement} nproc={nproc} {sync} k={every}: {time.perf_counter() - start:.0f} s", flush=True)
        results.append({"placement": placement, "processes": nproc, "embedding_sync": sync,
                        "sync_every": every if sync == "cache_avg" else None, **out})
    reference = next(r for r in results if r["placement"] == "lookahead" and r["processes"] == 2
                     and r["embedding_sync"] == "grad")
    for r in results:
        if r["embedding_sync"] == "cache_avg":
            r["drift_vs_grad"] = drift(r["weights"], reference["weights"])

    columns = ["placement", "processes", "embedding_sync", "sync_every", "samples_per_second", "comm_ms_per_step",
               "val_auc", "syncs", "early_syncs", "drift_vs_grad"]
    print(f"\n{args.steps} steps of global batch 256, {args.rows:,} synthetic rows, dlrm_small, SGD lr 0.1, "
          f"lookahead cache {args.cache_ratio:.0%} of rows, {args.threads} thread(s) per process\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    rows = []
    for r in results:
        row = {**r, "comm_ms_per_step": r["comm_per_step"] * 1000}
        rows.append({c: row.get(c) for c in columns})
        print("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    if args.record:
        from bench.record import record

        record(
            "Multi-process training", columns, rows,
            f"python -m bench.distributed_bench --rows {args.rows} --steps {args.steps} --threads {args.threads} "
            f"--cache-ratio {args.cache_ratio}",
            note="gloo on CPU via the elastic launcher; drift: largest weight difference from the 2-process "
                 "grad-sync run, relative to its tensor's largest magnitude.",
        )


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2e}" if abs(v) < 1e-2 and v != 0 else (f"{v:,.4f}" if abs(v) < 10 else f"{v:,.0f}")
    return str(v)


if __name__ == "__main__":
    main()
