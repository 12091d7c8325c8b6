"""The device check itself, on CPU: its dry run end to end (every stage on
CPU at tiny sizes), a stage that crashes or hangs recorded while the next
still runs, the exit codes, and the overlap measure of a profiler trace."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import bench.gpu_check as gpu_check

ROOT = Path(__file__).resolve().parents[1]


def assert_every_stage_passed(out: Path, stages: list[str] | None = None) -> dict:
    """The dry check's report in `out`: every stage (or those `stages`, in
    order) ran on CPU and reported what it saw. (tests/test_gpu_env.py runs
    the check as `make gpu-check-dry` does, in its own venv, with the tests
    stage; the test below every other stage, each in the check's child entry
    point; `make verify` the whole check in its own venv.)"""
    report = json.loads((out / "gpu_check.json").read_text())
    wanted = gpu_check.stage_names() if stages is None else stages
    assert [st["name"] for st in report["stages"]] == wanted
    assert all(st["status"] == "passed" and st["seconds"] < st["timeout_s"] for st in report["stages"])
    assert report["ok"] and report["exit_code"] == 0 and report["dry"]
    stages_by_name = {st["name"]: st for st in report["stages"]}
    ran = lambda name: name in stages_by_name  # noqa: E731
    if ran("exact"):
        assert stages_by_name["exact"]["details"]["checks"] == {
            f"fp32 {p} == device": True for p in ("lookahead", "cache", "host", "uvm")}
    if ran("determinism"):
        assert stages_by_name["determinism"]["details"]["checks"] == {"int8 lookahead run == run": True,
                                                                     "int8 lookahead evaluation == evaluation": True}
    assert all(stages_by_name[f"speed: {n}"]["details"]["samples_per_second"] > 0
               for n in gpu_check.SPEED_SYSTEMS if ran(f"speed: {n}"))
    if ran("overlap"):
        assert stages_by_name["overlap"]["details"]["fill_ranges"] > 0  # the fill copies are named in the trace
    if ran("sharded"):
        assert stages_by_name["sharded"]["details"]["checks"] and all(
            stages_by_name["sharded"]["details"]["checks"].values())
    table = (out / "gpu_check.md").read_text()
    assert ": PASSED" in table.splitlines()[0]
    if ran("speed: lookahead 1 %"):
        assert "| lookahead 1 % |" in table
    if ran("tests"):  # pytest's full output and its junit XML are kept
        tests = stages_by_name["tests"]["details"]
        junit = gpu_check.junit_counts(Path(tests["junit"]))
        assert junit["tests"] > 0 and junit["failures"] == junit["errors"] == 0
        assert "passed" in Path(tests["log"]).read_text() and tests["summary"].startswith(f"{junit['tests']} passed")
        assert "| tests | passed |" in table
    return report


def test_every_stage_but_tests_passes_the_dry_check(tmp_path, monkeypatch):
    """The dry check's every stage but `tests` (tests/test_gpu_env.py runs
    that one, in the check's own venv), through check() and run_stage: each
    stage's command runs the check's child entry point (main --stage ...,
    which writes the result the parent reads) in this process rather than a
    new one, which would import torch and warm up again, ~2 s a stage. (A
    stage in a real child process, its timeout and crash: the test after
    this; the whole check, every stage in its own process in its own venv:
    test_gpu_env's `make verify` test.)"""
    real_popen = subprocess.Popen

    class InProcess:
        def __init__(self, command, **kwargs):
            self.pid, self.returncode = -1, None
            gpu_check.main(command[3:])
            self.returncode = 0

        def wait(self, timeout=None):
            return self.returncode

    def popen(command, *args, **kwargs):
        if command[1:3] == ["-m", "bench.gpu_check"]:
            return InProcess(command, **kwargs)
        return real_popen(command, *args, **kwargs)

    stages = [name for name in gpu_check.stage_names() if name != "tests"]
    # The sharded stage sets its one-rank group's variables, as a child would in
    # its own environment. They must not outlive this test: a later `recsys
    # train` from this worker saw RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
    # took itself for a torchrun rank and failed to bind the stale port. (A
    # delenv of an absent key records nothing to undo; a setenv first does.)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(gpu_check.subprocess, "Popen", popen)
    threads = torch.get_num_threads()
    out = tmp_path / "report"
    args = gpu_check.parse_args(["--dry", "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
                                 "--work", str(tmp_path / "work"), "--stages", ",".join(stages)])
    try:
        code = gpu_check.check(args, ["--out", args.out, "--dry"])
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)  # the exact stages turn them on; conftest sets them per test
    report = assert_every_stage_passed(out, stages)
    assert code == 0 and [st["name"] for st in report["stages"]] == stages


def test_a_crashed_or_hung_stage_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setitem(gpu_check.TIMEOUTS, "data", 1)  # importing torch alone takes longer: killed
    args = gpu_check.parse_args(["--dry", "--out", str(tmp_path / "out"), "--cache-dir", str(not_a_dir),
                                 "--work", str(tmp_path / "work"), "--stages", "data,exact"])
    code = gpu_check.check(args, ["--out", args.out, "--dry"])
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    data, exact = report["stages"]
    assert data["status"] == "timed out" and "timed out after 1 s" in data["error"]
    assert exact["status"] == "crashed" and exact["error"].startswith("exit code 1:")  # datasets cannot go in a file
    assert code == gpu_check.EXIT_FAILED == report["exit_code"] and not report["ok"]
    assert "| data | timed out |" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_a_crash_of_the_check_itself_keeps_the_stages_done(tmp_path, monkeypatch):
    calls = []

    def run_stage(stage, *a):
        calls.append(stage)
        if len(calls) == 2:
            raise OSError("disk full")
        return {"name": stage, "status": "passed", "ok": True, "seconds": 1.0, "timeout_s": 5, "details": {}}

    monkeypatch.setattr(gpu_check, "run_stage", run_stage)
    monkeypatch.delenv("RECSYS_CACHE", raising=False)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the check makes its own folders
    args = gpu_check.parse_args(["--dry", "--out", str(tmp_path), "--stages", "data,exact,overlap"])
    assert gpu_check.check(args, []) == gpu_check.EXIT_CRASHED
    # its generated-data folder is gone; its work folder (logs, the trace) stays, as the report says
    (work,) = temp.iterdir()
    assert work.name.startswith("recsys-gpu-check-work-")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [st["name"] for st in report["stages"]] == ["data"] and report["error"] == "OSError: disk full"
    assert "INCOMPLETE" in (tmp_path / "gpu_check.md").read_text() and calls == ["data", "exact"]


def test_unknown_stages_are_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = gpu_check.parse_args(["--dry", "--out", str(tmp_path / "out"), "--stages", "exact,speed"])
    assert gpu_check.check(args, []) == gpu_check.EXIT_BAD_INPUT
    assert "unknown stage(s) speed" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before it made any folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_clearly_without_cuda(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == gpu_check.EXIT_NO_CUDA and "needs a CUDA device" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def _event(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_overlap_counts_only_fill_copies_under_compute_kernels():
    fill = gpu_check.FILL_RANGE
    events = [
        _event("kernel", "k", 0, 100, stream=7), _event("kernel", "k", 150, 150, stream=7),  # compute: stream 7
        _event("kernel", "k", 0, 5, stream=9),
        _event("user_annotation", fill, 10, 20, tid=2),  # the prefetcher thread's fill ranges
        _event("user_annotation", fill, 390, 20, tid=2),
        _event("cuda_runtime", "cudaMemcpyAsync", 12, 1, tid=2, correlation=1),
        _event("cuda_runtime", "cudaMemcpyAsync", 395, 1, tid=2, correlation=2),
        _event("cuda_runtime", "cudaMemcpyAsync", 15, 1, tid=3, correlation=3),  # the batch copier's thread
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 120, stream=9, correlation=1),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 400, 40, stream=9, correlation=2),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 300, stream=11, correlation=3),
    ]
    got = gpu_check.fill_overlap(events)
    # fills: 50..170 (50 + 20 us under kernels) and 400..440 (none); the batch copy is not a fill
    assert got["fill_copies"] == 2 and got["fill_copy_us"] == 160 and got["compute_stream"] == 7
    assert got["overlapped_share"] == pytest.approx(70 / 160)
    assert got["compute_busy_share"] == pytest.approx(250 / 300)  # kernels 0..100 and 150..300
    assert not got["ok"] and "goal 80%" in got["error"]  # under the goal: the stage fails
    busy = events + [_event("kernel", "k", 100, 50, stream=7), _event("kernel", "k", 380, 80, stream=7)]
    covered = gpu_check.fill_overlap(busy)
    assert covered["overlapped_share"] == pytest.approx(1.0) and covered["ok"] and covered.get("error") is None
    assert covered["compute_busy_share"] == pytest.approx(380 / 460)
    serial = gpu_check.fill_overlap([e for e in events if e["args"].get("correlation") != 1])
    assert not serial["ok"] and serial["overlapped_share"] == 0.0  # a fill after compute overlaps nothing
    unnamed = gpu_check.fill_overlap([e for e in events if e["name"] != fill])
    assert not unnamed["ok"] and "no host-to-device copy" in unnamed["error"]  # other copies never count


def test_the_overlap_stage_paces_the_gpu_slower_than_the_host():
    # Unlagged steps start every 17 ms after two slow first ones: the lag is 3 steps' worth, so the
    # compute stream (lag + the step's kernels) outlasts the host's step even under the profiler.
    starts = [0.0, 0.050, 0.080, 0.097, 0.115, 0.132, 0.148, 0.165, 0.182]
    host = gpu_check.unlagged_step_seconds(starts)
    assert host == pytest.approx(0.017)
    assert gpu_check.overlap_lag_ms(1000 * host) == pytest.approx(51.0)
    assert gpu_check.overlap_lag_ms(0.5) == gpu_check.OVERLAP_LAG_MIN_MS  # a fast host: the floor
