"""Start-up benchmark: seconds from process start to the first finished training step.

    .venv/bin/python -m bench.startup_bench [--scale 1.0] [--record] [-- OVERRIDES...]

Runs `recsys train model=dlrm_kaggle` (Kaggle cardinalities at --scale 1.0:
33.8M rows, 2.0 GiB of fp32 tables, device placement) in a fresh process that
stops right after its first step, and reports where the time went: Python
imports, config composition, dataset and manifest, building the tables,
the rest of the trainer's set-up (model, loaders), and the first step
(waiting for its batch included). Each phase in wall seconds and in the
process's CPU seconds (the machine may be shared: CPU seconds are what the
work costs, wall seconds what a user waits). The dataset is generated (and
cached) by a first, unmeasured run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, os, sys, time
marks = [("start", time.perf_counter(), time.process_time())]
def mark(name):
    marks.append((name, time.perf_counter(), time.process_time()))
import torch
from recsys_cli import cli
from recsys_cli.train import trainer as tr
mark("imports")
init, build, step = tr.Trainer.__init__, tr.build_embeddings, tr.Trainer.train_step
def timed_init(self, *a, **k):
    mark("config")
    init(self, *a, **k)
    mark("trainer set-up")
def timed_build(*a, **k):
    mark("dataset")
    out = build(*a, **k)
    mark("tables")
    return out
def timed_step(self, batch):
    loss = step(self, batch)
    loss.item()
    mark("first step")
    print("STARTUP " + json.dumps(marks), flush=True)
    os._exit(0)
tr.Trainer.__init__, tr.build_embeddings, tr.Trainer.train_step = timed_init, timed_build, timed_step
cli.main(["train", *sys.argv[1:]])
"""

PHASES = ["imports", "config", "dataset", "tables", "trainer set-up", "first step"]


def measure(overrides: list[str]) -> dict:
    began = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, *overrides], capture_output=True, text=True)
    wall_total = time.perf_counter() - began
    line = next((x for x in out.stdout.splitlines() if x.startswith("STARTUP ")), None)
    if line is None:
        raise SystemExit(f"the run did not reach its first step:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    marks = json.loads(line[len("STARTUP "):])
    result = {"wall to first step (s)": wall_total}
    for (_, w0, c0), (name, w1, c1) in zip(marks, marks[1:]):
        result[f"{name} wall"] = w1 - w0
        result[f"{name} cpu"] = c1 - c0
    result["cpu to first step (s)"] = marks[-1][2] - marks[0][2]
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0, help="dataset.synthetic.cardinality_scale (1.0: Kaggle's)")
    ap.add_argument("--rows", type=int, default=20_000, help="dataset.synthetic.rows")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    overrides = ["model=dlrm_kaggle", f"dataset.synthetic.cardinality_scale={args.scale}",
                 f"dataset.synthetic.rows={args.rows}", "trainer.checkpoint_every=null",
                 "trainer.progress=false", *args.overrides]
    # A fresh run directory per run: recsys refuses a second run into a directory that holds one.
    scratch = tempfile.TemporaryDirectory(prefix="recsys-startup-bench-")
    run_dir = lambda n: f"hydra.run.dir={scratch.name}/run-{n}"  # noqa: E731
    subprocess.run([sys.executable, "-m", "recsys_cli", "train", *overrides, "trainer.max_steps=1", run_dir("data")],
                   check=True, capture_output=True)  # the dataset, generated once
    rows = []
    for n in range(args.repeat):
        r = measure([*overrides, run_dir(n)])
        r["load average"] = os.getloadavg()[0]
        rows.append(r)
        print(json.dumps({k: round(v, 2) for k, v in r.items()}))
    best = min(rows, key=lambda r: r["wall to first step (s)"])
    print("phase            wall s   cpu s")
    for p in PHASES:
        print(f"{p:16} {best[p + ' wall']:6.2f} {best[p + ' cpu']:7.2f}")
    print(f"{'total':16} {best['wall to first step (s)']:6.2f} {best['cpu to first step (s)']:7.2f}")
    if args.record:
        from bench.record import record

        columns = ["wall to first step (s)", "cpu to first step (s)", *[f"{p} cpu" for p in PHASES], "load average"]
        record("Start-up (issue 18)", columns, [best], "python -m bench.startup_bench " + " ".join(sys.argv[1:]),
               note="Seconds from process start to the end of the first training step, `model=dlrm_kaggle` on "
                    "Kaggle cardinalities (2.0 GiB of fp32 tables), device placement, no checkpoints; per "
                    "phase the process's CPU seconds. Best of the repeats.")


if __name__ == "__main__":
    main()
