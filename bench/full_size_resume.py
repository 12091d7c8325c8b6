"""Kill -9 and resume at MLPerf DLRM-DCNv2's full size (issue 41 item 4).

    .venv/bin/python -m bench.full_size_resume --work /tmp/fullsize [--scale 1.0] [--rows 300000]
        [--steps 40] [--every 20]

Three `recsys train` processes of one config (model=dlrm_v2,
optimizer=mlperf_dcnv2, dataset=synthetic_mlperf, int4 tables on disk
behind a lookahead cache): "a" runs uninterrupted; "killed" is killed with
SIGKILL (its whole process group) as soon as its first checkpoint is
recorded; "resumed" resumes it to the end into the killed run's checkpoint
directory. The final checkpoints of "a" and "killed" must be equal: every
table row by row (a disk table is read whole from its chain of base and
deltas, one table at a time: the largest, 40M int4 rows, is 2.9 GB), every
other tensor with torch.equal, everything else with ==, timing aside; and
the resumed run's metrics lines equal the uninterrupted run's. tests/
test_disk_cli.py makes the same comparison at 1/50,000 of the rows in
`make test`; this is the claim at the size users care about, too long for
any suite (three full builds of a 14.7 GB table).

A disk table whose chain starts from the initial rows (no base file: the
initial rows are a function of the seed and the layout) is compared by its
layout and the last record of every row its deltas changed: with equal
layouts, equal changed rows mean equal tables (the rows no delta names are
the same initial rows on both sides), without building 26.1G initial values
twice. Any other table is read whole (materialize).

Prints, per process: wall seconds, peak RSS (the child's own, wait4), the
step it reached, and the disk bytes of its checkpoints; exits 1 on the
first difference, naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

TIMING = frozenset({"samples_per_second", "prepare_seconds", "prepare_wait_seconds", "phase_seconds"})


def config(args) -> list[str]:
    return ["model=dlrm_v2", "optimizer=mlperf_dcnv2", "dataset=synthetic_mlperf",
            f"dataset.synthetic.rows={args.rows}", f"dataset.synthetic.cardinality_scale={args.scale}",
            "precision=int4", "placement=disk", "placement.cache_ratio=0.01", "placement.host_cache_ratio=0.02",
            f"trainer.max_steps={args.steps}", f"trainer.checkpoint_every={args.every}", "trainer.log_every=5",
            "trainer.progress=false", f"placement.disk_path={args.work / 'live'}"]


def start(args, name: str, extra: list[str]) -> subprocess.Popen:
    recsys = Path(sys.executable).with_name("recsys")
    env = {**os.environ, "RECSYS_CACHE": str(args.work / "cache")}
    log = open(args.work / f"{name}.log", "w")
    return subprocess.Popen([str(recsys), "train", *config(args), *extra, f"hydra.run.dir={name}"], cwd=args.work,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, name: str, began: float, expect_ok: bool = True) -> dict:
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    row = {"run": name, "wall_s": round(time.perf_counter() - began, 1), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
           "exit": proc.returncode}
    if expect_ok and proc.returncode != 0:
        sys.exit(f"{name} exited {proc.returncode}: see {name}.log")
    print(json.dumps(row), flush=True)
    return row


def identical(a, b, where: str) -> None:
    """torch.equal on tensors, == on the rest; timing keys skipped."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        same = set(a) == set(b)
        if same:
            for k in a:
                if k not in TIMING:
                    identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        same = len(a) == len(b)
        if same:
            for i, (x, y) in enumerate(zip(a, b)):
                identical(x, y, f"{where}[{i}]")
    else:
        same = a == b
    if not same:
        sys.exit(f"DIFFERENT: {where}")


def changed_rows(saved: dict) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(layout without its file names, sorted row ids, their last records) of a
    disk table's deltas, applied in order."""
    from recsys_cli.embeddings.disk_checkpoint import _deltas

    pieces = list(_deltas(saved))
    ids = torch.cat([i for i, _ in pieces]) if pieces else torch.empty(0, dtype=torch.int64)
    records = torch.cat([r for _, r in pieces]) if pieces else torch.empty(0, saved["disk"]["record_bytes"],
                                                                           dtype=torch.uint8)
    ids, order = torch.sort(ids, stable=True)
    last = torch.ones_like(ids, dtype=torch.bool)
    last[:-1] = ids[1:] != ids[:-1]  # the last write of each row wins, as in a replay
    layout = {k: v for k, v in saved["disk"].items() if k not in ("base", "deltas", "delta_rows", "sums")}
    return layout, ids[last], records[order[last]]


def compare(a: Path, b: Path) -> int:
    """The two final checkpoints equal, tables one at a time; returns the rows compared."""
    from recsys_cli.checkpoints import load_checkpoint
    from recsys_cli.embeddings.disk_checkpoint import is_disk_table, materialize

    left, right = load_checkpoint(a), load_checkpoint(b)
    for state in (left, right):
        state.pop("config")  # names the run's own directories
        state["metrics"] = [{k: v for k, v in json.loads(m).items() if k not in TIMING} for m in state["metrics"]]
    tables_a, tables_b = left.pop("tables"), right.pop("tables")
    identical(left, right, "checkpoint")
    identical(sorted(tables_a), sorted(tables_b), "table names")
    rows = 0
    for name in sorted(tables_a):
        sa, sb = tables_a[name], tables_b[name]
        if is_disk_table(sa) and is_disk_table(sb) and sa["disk"]["base"] is None and sb["disk"]["base"] is None:
            identical(changed_rows(sa), changed_rows(sb), f"tables.{name}")
            rows += sa["disk"]["rows"]
            continue
        ta, tb = materialize(sa), materialize(sb)
        identical(ta, tb, f"tables.{name}")
        rows += next(t for t in ta.values() if isinstance(t, torch.Tensor)).shape[0]
        del ta, tb
    return rows


def metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--compare-only", action="store_true", help="compare the runs already in --work")
    args = parser.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.compare_only:
        run_all(args)
    final = f"step-{args.steps:08d}.pt"
    began = time.perf_counter()
    rows = compare(args.work / "a" / "checkpoints" / final, args.work / "killed" / "checkpoints" / final)
    identical(metrics(args.work / "resumed"), metrics(args.work / "a"), "metrics.jsonl")
    sizes = {run: sum(f.stat().st_size for f in (args.work / run / "checkpoints").rglob("*") if f.is_file())
             for run in ("a", "killed")}
    print(json.dumps({"equal": True, "table_rows_compared": rows, "compare_s": round(time.perf_counter() - began, 1),
                      "checkpoint_bytes": sizes}), flush=True)


def run_all(args) -> None:
    """The uninterrupted run, the killed one and its resumption."""

    began = time.perf_counter()
    finish(start(args, "a", []), "a", began)

    began = time.perf_counter()
    proc = start(args, "killed", [])
    latest = args.work / "killed" / "checkpoints" / "latest.json"
    while not latest.exists() and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    finish(proc, "killed", began, expect_ok=False)
    killed_at = json.loads(latest.read_text())["step"]
    print(json.dumps({"killed_after_checkpoint": killed_at}), flush=True)
    if killed_at >= args.steps:
        sys.exit("the run finished before it could be killed")

    began = time.perf_counter()
    finish(start(args, "resumed", ["trainer.resume=true", "trainer.checkpoint_dir=killed/checkpoints"]), "resumed",
           began)


if __name__ == "__main__":
    main()
