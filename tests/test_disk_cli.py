"""The disk tier from the command line: kill -9 and resume, bad disk paths, and
the memory of building a large table (each in its own process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from recsys_cli.embeddings.disk_checkpoint import materialize
from recsys_cli.checkpoints import load_checkpoint
from commands import RECSYS, train_in_process
from test_resume_exact import SMALL, assert_identical, records, recsys

DISK = ["+placement=disk", "placement.host_cache_rows=50", "placement.cache_ratio=0.2", "trainer.batch_size=64",
        "optimizer=adagrad", "trainer.progress=false", "trainer.checkpoint_every=30", "trainer.log_every=10",
        "trainer.eval_every=60"]


def final_state(run: Path, steps: int) -> dict:
    """The final checkpoint with disk tables read whole (file names differ between runs, rows must not)."""
    state = load_checkpoint(run / "checkpoints" / f"step-{steps:08d}.pt")
    state.pop("config")
    state["metrics"] = [{k: v for k, v in m.items() if k not in ("samples_per_second", "phase_seconds")}
                        if isinstance(m, dict) else m for m in map(json.loads, state["metrics"])]
    state["tables"] = {name: materialize(t) for name, t in state["tables"].items()}
    return state


@pytest.mark.exact  # bit-for-bit: under deterministic algorithms (tests/conftest.py)
@pytest.mark.parametrize("mode", [
    pytest.param(["+precision=int8"], id="int8"),
    # every rank has its own live file; rank 0 writes the checkpoint's chain, every rank resumes from it
    # (cache_avg keeps fp32 tables; int8 on disk is the row above)
    pytest.param(["trainer.nproc=2", "trainer.embedding_sync=cache_avg", "trainer.sync_every=3"],
                 id="cache_avg-2-processes", marks=pytest.mark.slow),
    # the same with gradient averaging and int8: the suite's time, so in `make verify`
    pytest.param(["+precision=int8", "trainer.nproc=2"], id="int8-2-processes",
                 marks=[pytest.mark.slow, pytest.mark.verify]),
])
def test_kill_9_and_resume_equals_the_uninterrupted_run(tmp_path, mode):
    steps = 60  # the kill lands after the checkpoint at 30; the resumed half ends with the evaluation at 60
    args = [*SMALL, *DISK, *mode, f"trainer.max_steps={steps}", f"placement.disk_path={tmp_path / 'live'}"]
    work = tmp_path / "work"
    work.mkdir()
    recsys(args, work, "a")
    proc = recsys(args, work, "killed", wait=False)
    latest = work / "killed" / "checkpoints" / "latest.json"
    deadline = time.time() + 300
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < steps, "the run finished before it could be killed"
    recsys([*args, "trainer.resume=true", "trainer.checkpoint_dir=killed/checkpoints"], work, "resumed")
    assert_identical(final_state(work / "a", steps), final_state(work / "killed", steps))
    assert records(work / "resumed") == records(work / "a")
    summary = json.loads((work / "a" / "summary.json").read_text())
    assert summary["cache"]["disk_bytes_read_per_step"] > 0 and summary["embedding_bytes"]["disk"] > 0
    # recsys report's rows carry the disk statistics
    from recsys_cli.report import load_run, report_rows

    row = report_rows([load_run(work / "a" / "summary.json", work)])[0]
    assert row["disk_bytes"] == summary["embedding_bytes"]["disk"]
    assert row["disk_bytes_read_per_step"] == summary["cache"]["disk_bytes_read_per_step"] > 0
    assert 0 <= row["host_cache_hit_rate"] <= 1 and row["disk_read_amplification"] >= 1
    # every run removes its live tables at exit; the killed one's went when the resumed run started
    assert not [p for p in (tmp_path / "live").iterdir() if p.name.startswith("recsys-disk-")]


def test_an_unwritable_disk_path_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = train_in_process([*SMALL, *DISK, "trainer.max_steps=2", f"placement.disk_path={blocker / 'tables'}",
                               f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capsys=capsys,
                              monkeypatch=monkeypatch)  # the line, not the process: commands.train_in_process
    assert result.returncode == 2, result.stderr[-2000:]
    err = result.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert str(blocker / "tables") in err and "placement.disk_path" in err


def test_a_live_table_truncated_mid_training_stops_the_run_and_keeps_the_checkpoint(tmp_path):
    """The live file truncated to 0 bytes after the first checkpoint: the run
    trained on to exit 0 with wrong rows (issue 27); now the next read or
    write of the store stops it, one line naming the file, exit 2, and the
    checkpoint stays whole."""
    live = tmp_path / "live"
    env = {**os.environ, "RECSYS_CACHE": str(tmp_path / "cache")}
    cmd = [RECSYS, "train", *SMALL, *DISK, "trainer.max_steps=100000", "trainer.checkpoint_every=10",
           f"placement.disk_path={live}", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = tmp_path / "run" / "checkpoints" / "latest.json"
    deadline = time.time() + 300  # a liveness bound far above the seconds the first checkpoint takes
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    (table,) = live.glob("recsys-disk-*/rows.bin")
    os.truncate(table, 0)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: {table}: ") and "truncated" in lines[0], lines[0]
    assert "resume from it (trainer.resume=true)" in lines[0], lines[0]
    ok = subprocess.run([RECSYS, "verify", str(tmp_path / "run")], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr  # the last checkpoint's files are whole


FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, {tests!r})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit: the disk is "full" past 4 KiB
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 12, 1 << 12))
    from embedding_harness import build
    from recsys_cli.errors import UserError
    try:
        build({{"kind": "disk", "cache_rows": 90, "disk_path": {path!r}}}, optimizer="adagrad")
    except UserError as e:
        print(e)
        sys.exit(2)
""")


def test_a_full_disk_is_a_clear_error(tmp_path, monkeypatch):
    # The disk's free space is checked first...
    import shutil

    from embedding_harness import build
    from recsys_cli.errors import UserError

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(UserError, match=r"need [\d,]+ bytes but the disk has 1,000 free"):
        build({"kind": "disk", "cache_rows": 90, "disk_path": str(tmp_path / "t")})
    monkeypatch.undo()
    assert not list((tmp_path / "t").iterdir())  # nothing left behind
    # ...and a write that fails for lack of space (here: a file-size limit) says so.
    script = FULL_DISK.format(tests=str(Path(__file__).parent), path=str(tmp_path / "t"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "no space left" in result.stdout and str(tmp_path / "t") in result.stdout, result.stdout
    assert not list((tmp_path / "t").iterdir())


BUILD = textwrap.dedent("""
    import sys, torch
    from recsys_cli.embeddings.disk_store import DiskRowStore
    from recsys_cli.train.memory import peak_rss_bytes
    from recsys_cli.embeddings.table_init import TableSpec
    spec = TableSpec("big", {rows}, {dim})
    torch.empty(1)  # torch's own start-up memory before the baseline
    before = peak_rss_bytes()
    store = DiskRowStore([spec], [0], {precision!r}, "stochastic", 0, 1, 0.0, {path!r}, host_cache_rows=1000)
    after = peak_rss_bytes()
    print(before, after, store.num_rows * store.record_bytes)
    print(f"peak RSS grew by {{after - before:,}} bytes for a {{store.num_rows * store.record_bytes:,}}-byte table",
          file=sys.stderr)
""")


def test_building_a_large_disk_table_needs_memory_for_one_chunk(tmp_path):
    """A 1M x 32 table (132 MB in fp32 with Adagrad state) is built straight
    into its file: the process's peak RSS grows by far less than the table.
    (Low precision builds through the same chunks; its bits are tested in test_disk.py.)"""
    script = BUILD.format(rows=1_000_000, dim=32, precision="fp32", path=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after, table = map(int, result.stdout.split())
    assert table > 120 << 20
    assert after - before < 32 << 20, f"peak RSS grew by {after - before:,} bytes building a {table:,}-byte table"
