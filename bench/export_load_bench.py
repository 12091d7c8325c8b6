"""Seconds to load a `recsys export` artifact in a fresh Python, by part.

    python -m bench.export_load_bench MODEL.pt2 [MODEL.scorer.pt ...] [--repeat 5] [--record]

Each repeat is a new process (what a scoring job pays), one row per file,
its format told by its contents. format=pt2, as a user with torch alone
loads it: `import torch`, then `torch.export.load` split into importing
torch.export's archive reader (torch._dynamo, torch._export.serde: the bulk
of it) and reading the program, then `.module()`. format=module:
`import torch`, then importing `recsys_cli.export` (the reader), then
`load_scorer` (the CRC-32 check, torch.load(weights_only=True), rebuilding
the module; `module` is 0). Both end with a first call on 4 rows. Medians
over the repeats; the load average beside them (the machine may be shared).
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

CHILD_MODULE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from recsys_cli.export import load_scorer
t2 = time.perf_counter()
model = load_scorer(sys.argv[1])
t3 = time.perf_counter()
num_dense, num_sparse = model.dlrm.bottom[0].in_features, len(model.dlrm.embeddings.features)
model(torch.zeros(4, num_dense, dtype=torch.int64), torch.zeros(4, num_sparse, dtype=torch.int64))
t4 = time.perf_counter()
assert "torch._dynamo" not in sys.modules
print(json.dumps({"import_torch": t1 - t0, "import_reader": t2 - t1, "read": t3 - t2, "module": 0.0,
                  "first_call": t4 - t3, "load_total": t4 - t1}))
"""

PARTS = ["import_torch", "import_reader", "read", "module", "first_call", "load_total"]
PT2_NAMES = {"import_export_reader": "import_reader", "read_program": "read"}


def measure(path: str, repeat: int) -> dict:
    from recsys_cli.export import artifact_format

    fmt = artifact_format(path)
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", CHILD if fmt == "pt2" else CHILD_MODULE, path],
                             capture_output=True, text=True, check=True)
        run = json.loads(out.stdout.strip().splitlines()[-1])
        runs.append({PT2_NAMES.get(k, k): v for k, v in run.items()})
    return {"format": fmt, **{k: statistics.median(r[k] for r in runs) for k in PARTS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="artifacts of `recsys export` (format=pt2 or module)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--record", action="store_true", help="append the rows to BENCHMARKS.md")
    args = ap.parse_args()
    rows = []
    for path in args.models:
        load_before = os.getloadavg()[0]
        row = measure(path, args.repeat)
        row = {"format": row.pop("format"), "file MiB": os.path.getsize(path) / 2**20, **row,
               "load avg": f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"}
        print(json.dumps(row, indent=1))
        rows.append(row)
    if args.record:
        from bench.record import record

        names = " ".join(os.path.basename(m) for m in args.models)
        record("Export: seconds to load an artifact in a fresh process (median)", list(rows[0]), rows,
               f"python -m bench.export_load_bench {names} --repeat {args.repeat}",
               note="Each part in a new Python process; `load_total` is everything after `import torch` up to "
                    "the first call's result. For format=pt2 most of it is importing torch.export's archive "
                    "reader (torch._dynamo and torch._export.serde), which torch.export.load does on first use; "
                    "format=module reads with recsys_cli.export.load_scorer and imports neither.")


if __name__ == "__main__":
    main()
