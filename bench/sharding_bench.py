"""Sharded tables (issue 29): memory per rank as processes are added, and what the step pays.

    .venv/bin/python -m bench.sharding_bench [--steps 100] [--rows 20000] [--nprocs 1,2,4] [--record]

`model=dlrm_kaggle` on Kaggle cardinalities (33.8M rows; 2.0 GiB of fp32
tables at dim 16), SGD, global batch 128, CPU, the run's default (final)
checkpoint on. Two systems: fp32 tables on the device placement, and int8
tables behind a 5 % lookahead cache. For each: one process (the
reference), then N processes with placement.sharding=table, row and auto,
and N processes replicated (trainer.embedding_sync=grad, every rank a
whole copy). Each run is its own `recsys train trainer.nproc=N` command;
every rank's peak RSS is its VmHWM (summary.json:
distributed.peak_host_rss_bytes_per_rank). The goal per rank: tables/N +
1.1x the one-process run's non-table memory (its peak minus its tables).
Bytes per step: what one rank sends by all-to-all (ids, pooled rows and
their gradients) beside the replicated run's all-reduce (dense and row
gradients). samples/s: summary.json's steady state; with more processes
than cores (N=4 on 2 cores: trainer.oversubscribe) it measures
oversubscription, not sharding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 2**20
SYSTEMS = [
    ("fp32 device", []),
    ("int8 + lookahead 5 %", ["placement=lookahead", "placement.cache_ratio=0.05", "precision.kind=int8"]),
]


def run(name: str, extra: list[str], nproc: int, sharding: str, steps: int, rows: int, workdir: Path) -> dict:
    tag = f"{name}-{sharding}-{nproc}".replace(" ", "_").replace("%", "pct").replace("+", "")
    run_dir = workdir / tag
    cmd = [sys.executable, "-m", "recsys_cli", "train", "model=dlrm_kaggle", "dataset.synthetic.cardinality_scale=1.0",
           f"dataset.synthetic.rows={rows}", f"trainer.max_steps={steps}", "trainer.batch_size=128",
           "trainer.progress=false", "trainer.device=cpu", f"trainer.nproc={nproc}", "trainer.oversubscribe=true",
           f"hydra.run.dir={run_dir}", *extra]
    if nproc > 1 and sharding != "replicated":
        cmd.append(f"placement.sharding={sharding}")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tag} failed:\n{out.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    dist = summary.get("distributed") or {}
    peaks = dist.get("peak_host_rss_bytes_per_rank") or [summary["peak_host_rss_bytes"]]
    plan = summary.get("sharding") or {}
    return {"system": name, "processes": nproc, "sharding": sharding if nproc > 1 else "-",
            "peak RSS per rank MiB (max)": max(peaks) / MiB, "peak RSS summed MiB": sum(peaks) / MiB,
            "rank 0 tables MiB": summary["embedding_bytes"]["table"] / MiB,
            "imbalance": plan.get("imbalance"),
            "all-to-all bytes/step": dist.get("all_to_all_bytes_per_step"),
            "all-reduce bytes/step": dist.get("all_reduce_bytes_per_step"),
            "samples/s": summary["samples_per_second"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rows", type=int, default=20_000, help="synthetic dataset rows (Kaggle cardinalities)")
    ap.add_argument("--nprocs", default="2,4")
    ap.add_argument("--systems", default="0,1", help="indices into SYSTEMS")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    nprocs = [int(n) for n in args.nprocs.split(",")]
    load = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="recsys-sharding-bench-") as tmp:
        for i in (int(s) for s in args.systems.split(",")):
            name, extra = SYSTEMS[i]
            alone = run(name, extra, 1, "-", args.steps, args.rows, Path(tmp))
            tables = alone["rank 0 tables MiB"]
            non_table = alone["peak RSS per rank MiB (max)"] - tables
            alone["goal per rank MiB"] = None
            print(json.dumps(alone), flush=True)
            results.append(alone)
            for n in nprocs:
                for sharding in ("table", "row", "auto", "replicated"):
                    r = run(name, extra, n, sharding, args.steps, args.rows, Path(tmp))
                    r["goal per rank MiB"] = tables / n + 1.1 * non_table if sharding != "replicated" else None
                    r["x one process's samples/s"] = r["samples/s"] / alone["samples/s"]
                    print(json.dumps(r), flush=True)
                    results.append(r)
    for r in results:
        r["load average"] = " ".join(f"{x:.1f}" for x in load)
    if args.record:
        from bench.record import record

        record("Sharded tables (issue 29): peak RSS per rank, bytes per step",
               ["system", "processes", "sharding", "peak RSS per rank MiB (max)", "goal per rank MiB",
                "peak RSS summed MiB", "rank 0 tables MiB", "imbalance", "all-to-all bytes/step",
                "all-reduce bytes/step", "samples/s", "x one process's samples/s", "load average"],
               results, "python -m bench.sharding_bench " + " ".join(sys.argv[1:]),
               note="`recsys train model=dlrm_kaggle` on Kaggle cardinalities (33.8M rows), global batch 128, CPU, "
                    "SGD, the default final checkpoint on, each run its own command; every rank's peak RSS is its "
                    "VmHWM. Goal per rank: tables/N + 1.1x the one-process run's non-table memory. Bytes per step: "
                    "what one rank sends (all-to-all: ids, pooled rows and their gradients; replicated: the "
                    "all-reduce of dense and row gradients). With more processes than cores samples/s measures "
                    "oversubscription.")


if __name__ == "__main__":
    main()
