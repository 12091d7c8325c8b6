"""Seconds to load a `recsys export` artifact in a fresh Python, by part.

    python -m bench.export_load_bench MODEL.pt2 [--repeat 5] [--record]

Each repeat is a new process (what a scoring job pays): `import torch`, then
`torch.export.load` split into importing torch.export's archive reader
(torch._dynamo, torch._export.serde: the bulk of it) and reading the
program, then `.module()` and a first call on 4 rows. Medians over the
repeats; the load average beside them (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import torch.export.pt2_archive._package  # what torch.export.load imports first
t2 = time.perf_counter()
program = torch.export.load(sys.argv[1])
t3 = time.perf_counter()
model = program.module()
t4 = time.perf_counter()
sig = program.graph_signature.user_inputs
args = [spec.meta["val"] for spec in program.graph.nodes if spec.op == "placeholder" and spec.name in sig]
model(*(torch.zeros((4, *a.shape[1:]), dtype=a.dtype) for a in args))
t5 = time.perf_counter()
print(json.dumps({"import_torch": t1 - t0, "import_export_reader": t2 - t1, "read_program": t3 - t2,
                  "module": t4 - t3, "first_call": t5 - t4, "load_total": t5 - t1}))
"""

PARTS = ["import_torch", "import_export_reader", "read_program", "module", "first_call", "load_total"]


def measure(path: str, repeat: int) -> dict:
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in PARTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--record", action="store_true", help="append the row to BENCHMARKS.md")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    row = measure(args.model, args.repeat)
    row = {"file MiB": os.path.getsize(args.model) / 2**20, **row,
           "load avg": f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"}
    print(json.dumps(row, indent=1))
    if args.record:
        from bench.record import record

        record("Export: seconds to load an artifact in a fresh process (median)", list(row), [row],
               f"python -m bench.export_load_bench {os.path.basename(args.model)} --repeat {args.repeat}",
               note="Each part in a new Python process; `load_total` is everything after `import torch` up to "
                    "the first call's result. Most of it is importing torch.export's archive reader "
                    "(torch._dynamo and torch._export.serde), which torch.export.load does on first use.")


if __name__ == "__main__":
    main()
