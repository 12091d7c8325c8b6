"""Table build rate (issue 41 item 4): an int4 dim-128 table built as `recsys train` builds it, against a commit before.

    .venv/bin/python -m bench.table_build_bench [--rows 400000] [--rounds 3] [--against f6ca939] [--store disk|host]

Each round builds the table once with this checkout's code and once with the
code of --against (its recsys_cli, from `git archive`, first on the child's
PYTHONPATH), alternating, each build in its own child process on every core
(as placement.py and the disk store build), so the machine's load weighs on
both alike. A child builds one table of --rows rows (a DiskRowStore's file
with its row-wise Adagrad state, placement=disk; or a RowStore in host
memory) and prints its wall and CPU seconds and the sha256 of the bytes
built; the bench checks both builds' bytes are equal and prints values/s,
CPU ns a value and the ratio of each round. At MLPerf DLRM-DCNv2's size
(204,184,588 rows x 128 = 26.1G values) the build takes 26.1G / (values/s).

    .venv/bin/python -m bench.table_build_bench --stages [--rows 400000] [--threads 1]

builds one disk table in this process with each stage of the build timed
(the fp32 draw, the rounding hashes, the noise, the quantizer and its parts,
the write), summed over the build threads, in ns a value: where the time
goes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MLPERF_VALUES = 204_184_588 * 128
DIM = 128


def build(rows: int, store: str) -> dict:
    """Build one table here (the child's side) and describe it."""
    import numpy as np
    import torch

    from recsys_cli.embeddings.table_init import TableSpec

    spec = TableSpec("C1", rows, DIM)
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        wall, cpu = time.perf_counter(), time.process_time()
        if store == "disk":
            from recsys_cli.embeddings.disk_store import DiskRowStore

            disk = DiskRowStore([spec], [0], "int4", "stochastic", 0, 1, 0.0, tmp, host_cache_rows=0)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            digest.update(np.fromfile(disk.path, dtype=np.uint8).tobytes())
            disk.close()
        else:
            from recsys_cli.embeddings.store import RowStore
            from recsys_cli.embeddings.table_init import build_initial_rows

            host = RowStore(rows, DIM, torch.zeros(rows, 1), precision="int4", seed=0, table_rows=[(0, rows)])
            build_initial_rows([spec], 0, host.write_initial, into=host.initial_view, workers=torch.get_num_threads())
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            for t in host.rows.tensors().values():
                digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return {"wall": wall, "cpu": cpu, "sha256": digest.hexdigest()}


def stages(rows: int, threads: int) -> None:
    """One disk table built here with its stages timed (module docstring)."""
    import torch

    from bench.timing import time_calls
    from recsys_cli.embeddings import quant, table_init
    from recsys_cli.embeddings.disk_store import DiskRowStore
    from recsys_cli.embeddings.table_init import TableSpec

    seconds: dict[str, float] = {}
    for owner, name, label in [
        (table_init, "_draw", "fp32 draw (Mersenne twister, scale)"),
        (DiskRowStore, "_write_initial", "encode and write (below, and the optimizer state)"),
        (quant.RoundingKey, "hashes", "  rounding hashes"),
        (quant, "uniform_noise", "  hashes -> uniform noise"),
        (quant, "quantize_rows", "  int4 quantizer (below, and subtract/divide/clamp/pack)"),
        (quant, "_row_extremes", "    row min/max"),
        (quant, "_grid", "    fp16 grid"),
        (quant, "_round_", "    round"),
        (DiskRowStore, "_pwrite_range", "  pwrite"),
    ]:
        time_calls(owner, name, seconds, label)
    torch.set_num_threads(threads)  # the build's threads (DiskRowStore._build)
    values = rows * DIM
    with tempfile.TemporaryDirectory() as tmp:
        wall, cpu = time.perf_counter(), time.process_time()
        DiskRowStore([TableSpec("C1", rows, DIM)], [0], "int4", "stochastic", 0, 1, 0.0, tmp, host_cache_rows=0).close()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{threads} build threads: {values / wall / 1e6:.1f}M values/s, {cpu / values * 1e9:.1f} CPU ns a value")
    for label, s in seconds.items():
        print(f"  {label}: {s / values * 1e9:.2f} ns a value")


def child(code: str, rows: int, store: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (code, os.environ.get("PYTHONPATH")) if p))
    # this file as a script (its folder first on sys.path, not the checkout): recsys_cli from `code`
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--rows", str(rows), "--store", store],
                         env=env, check=True, capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", default="f6ca939", help="the commit to compare with (git rev)")
    parser.add_argument("--store", choices=["disk", "host"], default="disk")
    parser.add_argument("--stages", action="store_true", help="time each stage of one disk build here")
    parser.add_argument("--threads", type=int, default=1, help="--stages: build threads")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stages:
        stages(args.rows, args.threads)
        return
    if args.child:
        print(json.dumps(build(args.rows, args.store)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    values = args.rows * DIM
    ratios = []
    with tempfile.TemporaryDirectory() as before:
        archive = subprocess.run(["git", "-C", here, "archive", args.against, "recsys_cli"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", before], input=archive, check=True)
        for r in range(args.rounds):
            old, new = child(before, args.rows, args.store), child(here, args.rows, args.store)
            assert old["sha256"] == new["sha256"], f"round {r}: the builds' bytes differ"
            ratios.append(old["wall"] / new["wall"])
            print(f"round {r}: {args.against} {values / old['wall'] / 1e6:.1f}M values/s "
                  f"({old['cpu'] / values * 1e9:.1f} CPU ns/value), this checkout {values / new['wall'] / 1e6:.1f}M "
                  f"values/s ({new['cpu'] / values * 1e9:.1f} CPU ns/value), {ratios[-1]:.2f}x, equal bytes", flush=True)
    print(f"median {statistics.median(ratios):.2f}x ({args.store}, {os.cpu_count()} cores); MLPerf's tables "
          f"({MLPERF_VALUES / 1e9:.1f}G values) at the last round's rate: {MLPERF_VALUES * new['wall'] / values:.0f} s")


if __name__ == "__main__":
    main()
