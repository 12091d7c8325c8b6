"""Preprocessing against the bare parse limit, alternating in one sitting (issue 41 item 3).

    .venv/bin/python -m bench.preprocess_scale_bench --input '/tmp/tb/plain/day_*' \
        --run hash_buckets=40000000 --run min_count=2,memory_budget=4GiB [--workers 2] [--record]

The input is day files of raw Criteo TSV (plain or .gz), e.g. made by
`recsys preprocess synthetic profile=terabyte cardinality_scale=1 rows=30000000 days=3 format=tsv output=DIR`.
Each configuration (--run, comma-separated key=value of CriteoConfig, split_by=terabyte unless given) is
timed right after a bare parse of the same files, each in its own child process (so peak RSS is
its own): the bare parse is pyarrow.csv.read_csv of the files' text, in pieces of 256 MiB cut at
line ends, with the column types and options the preprocessor's parser uses (BlockParser), arrow's
threads on every core, gunzipped on the fly for .gz, the tables discarded. The ratio is the bare
parse's seconds over preprocessing's; rows/s, CPU seconds and peak RSS (VmHWM) come with it, and
the load average at the start of each run. The shards are written under --work and deleted.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CRITEO_1TB_ROWS = 4_373_472_329  # Criteo 1TB's 24 days

_BARE = r"""
import json, os, sys, time
import pyarrow as pa, pyarrow.csv as pacsv
from data_tools.criteo_text import BlockParser
p = BlockParser()
load = os.getloadavg()[0]
t = time.perf_counter(); c = time.process_time(); rows = 0
for path in sys.argv[1:]:
    stream = pa.input_stream(path, compression="gzip" if path.endswith(".gz") else None)
    rest = b""
    while True:
        piece = stream.read(256 << 20)
        data = rest + piece
        cut = data.rfind(b"\n") + 1 if piece else len(data)
        rest = data[cut:]
        if cut:
            rows += pacsv.read_csv(pa.py_buffer(data[:cut]), p.read_options, p.parse_options, p.convert_options).num_rows
        if not piece:
            break
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c, "rows": rows,
                  "peak_rss_mb": int(hwm) / 1024, "load_1m": load}))
"""

_PREPROCESS = r"""
import json, os, sys, time
from rich.console import Console
from data_tools.criteo import CriteoConfig, preprocess
cfg = CriteoConfig(**json.loads(sys.argv[1]))
load = os.getloadavg()[0]
t = time.perf_counter(); c = time.process_time()
m = preprocess(cfg, console=Console(file=sys.stderr))
dt = time.perf_counter() - t
self = time.process_time() - c
import resource
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({"seconds": dt, "cpu_seconds": self + kids.ru_utime + kids.ru_stime,
                  "rows": sum(s.rows for s in m.splits.values()), "peak_rss_mb": int(hwm) / 1024,
                  "workers_peak_rss_mb": kids.ru_maxrss / 1024, "load_1m": load}))
"""


def _child(code: str, args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _options(text: str) -> dict:
    out: dict = {}
    for kv in filter(None, text.split(",")):
        key, _, value = kv.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="a glob of day files")
    ap.add_argument("--run", action="append", default=[], help="CriteoConfig options, comma-separated key=value")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/recsys-prep-bench"))
    ap.add_argument("--record", action="store_true", help="append the rows to BENCHMARKS.md")
    args = ap.parse_args(argv)
    paths = sorted(glob.glob(args.input), key=lambda s: [int(t) if t.isdigit() else t for t in __import__("re").split(r"(\d+)", s)])
    if not paths:
        raise SystemExit(f"no file matches {args.input}")
    size_mb = sum(os.path.getsize(p) for p in paths) / 1e6
    results = []
    for run in args.run or ["hash_buckets=40000000"]:
        options = {"split_by": "terabyte", "workers": args.workers, **_options(run)}
        if isinstance(options.get("memory_budget"), str):
            from recsys_cli.embeddings.placement_bytes import parse_bytes

            options["memory_budget"] = parse_bytes(options["memory_budget"], "memory_budget")
        bare = _child(_BARE, paths)
        out = args.work / "out"
        shutil.rmtree(out, ignore_errors=True)
        try:
            ours = _child(_PREPROCESS, [json.dumps({"input": paths, "output": str(out), "progress": False, **options})])
        finally:
            shutil.rmtree(out, ignore_errors=True)
        res = {"input": args.input, "input_mb": size_mb, "options": run, "bare": bare, "preprocess": ours,
               "ratio": bare["seconds"] / ours["seconds"],
               "criteo_1tb_hours": CRITEO_1TB_ROWS / (ours["rows"] / ours["seconds"]) / 3600}
        print(json.dumps(res), flush=True)
        results.append(res)
    if args.record:
        from bench.record import record

        command = "python -m bench.preprocess_scale_bench " + " ".join(argv if argv is not None else sys.argv[1:])
        record("Preprocessing at Terabyte scale: against the bare parse limit (issue 41)",
               ["input", "rows", "input MB", "options", "bare parse s", "preprocess s", "ratio", "rows/s",
                "CPU s", "peak RSS MB (main / a worker)", "load (bare / ours)", "Criteo 1TB h"],
               [{"input": r["input"], "rows": r["preprocess"]["rows"], "input MB": r["input_mb"],
                 "options": r["options"], "bare parse s": r["bare"]["seconds"],
                 "preprocess s": r["preprocess"]["seconds"], "ratio": r["ratio"],
                 "rows/s": r["preprocess"]["rows"] / r["preprocess"]["seconds"],
                 "CPU s": r["preprocess"]["cpu_seconds"],
                 "peak RSS MB (main / a worker)": f"{r['preprocess']['peak_rss_mb']:,.0f} / "
                                                  f"{r['preprocess']['workers_peak_rss_mb']:,.0f}",
                 "load (bare / ours)": f"{r['bare']['load_1m']:.1f} / {r['preprocess']['load_1m']:.1f}",
                 "Criteo 1TB h": r["criteo_1tb_hours"]} for r in results],
               command.replace(" --record", "").strip(),
               note="Goal (issue 41): >= 0.8x of the bare parse limit (pyarrow read_csv of the same text, same "
                    "column types, both cores, output discarded), each run right after its bare parse; peak RSS "
                    "<= 2 GiB. The Criteo 1TB column extrapolates 4.37B rows at the run's rows/s.")
    return results


if __name__ == "__main__":
    main()
