"""The command line, end to end: a run is a function of (config, seed, data),
and kill -9 + `trainer.resume=true` ends bit for bit where the uninterrupted
run ends (every checkpoint tensor, every logged loss, the final metrics).

`make test` checks lookahead + int8 behind a cache smaller than one batch on
the small synthetic data; `make verify` adds int4, cache + int8, auto + int8
and cache_avg on two processes, and the issue's own command on the default
data.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from embedding_harness import assert_identical as harness_identical
from recsys_cli import checkpoints as shards
from commands import RECSYS

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)

SMALL = ["dataset.synthetic.rows=20000", "dataset.synthetic.cardinality_scale=0.0005"]
COMMON = ["trainer.progress=false", "trainer.checkpoint_every=30", "trainer.log_every=10", "trainer.eval_every=60"]
TIMING = {"samples_per_second", "prepare_seconds", "prepare_wait_seconds", "phase_seconds"}  # measured, not computed: the only values allowed to differ


def recsys(args, cwd: Path, run_dir: str, wait=True):
    env = {**os.environ, "RECSYS_CACHE": str(cwd.parent / "cache")}
    cmd = [RECSYS, "train", *args, f"hydra.run.dir={run_dir}"]
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def without_timing(lines) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def records(run: Path) -> list[dict]:
    return without_timing((run / "metrics.jsonl").read_text().splitlines())


def assert_identical(a, b, where="checkpoint"):
    """torch.equal on every tensor, == on everything else, timing aside."""
    harness_identical(a, b, where, frozenset(TIMING))


def final_checkpoint(run: Path, steps: int) -> dict:
    path = run / "checkpoints" / f"step-{steps:08d}.pt"
    state = torch.load(path, weights_only=False)
    state.pop("config")  # names the run's own directories
    if shards.is_sharded(state["tables"]):  # the tables and each rank's caches, from the shard directory
        directory = path.parent / state["tables"]["sharded"]
        state["tables"] = shards.assemble_tables(directory, keep_patches=True)
        world = state["strategy"]["world_size"]
        state["caches"] = [shards.load_rank_caches(directory, rank, world) for rank in range(world)]
    state["metrics"] = without_timing(state["metrics"])  # the metrics.jsonl lines so far
    return state


def check_combination(tmp_path: Path, args: list[str], steps: int, data=SMALL, twice=True) -> Path:
    """Run `args` twice and compare, then kill -9 + resume and compare with
    the first run; the work directory, whose run "a" is the uninterrupted one.
    `twice=False` leaves out the second run: the resumed run's equality holds
    the same claim (its first part is another run of the same config)."""
    args = [*data, *COMMON, f"trainer.max_steps={steps}", *args]
    work = tmp_path / "work"
    work.mkdir()
    recsys(args, work, "a")
    if twice:
        recsys(args, work, "b")
        # Twice: the same metrics (throughput aside) and the same checkpoint, tensor for tensor.
        assert records(work / "a") == records(work / "b")
        assert_identical(final_checkpoint(work / "a", steps), final_checkpoint(work / "b", steps))

    # kill -9 at a random moment after the first checkpoint, then resume.
    proc = recsys(args, work, "killed", wait=False)
    latest = work / "killed" / "checkpoints" / "latest.json"
    deadline = time.time() + 300
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    time.sleep(random.Random(len(args)).random() * 0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < steps, "the run finished before it could be killed"
    recsys([*args, "trainer.resume=true", "trainer.checkpoint_dir=killed/checkpoints"], work, "resumed")
    assert_identical(final_checkpoint(work / "a", steps), final_checkpoint(work / "killed", steps))
    # The resumed run rewinds metrics.jsonl to the checkpoint and goes on: the uninterrupted run's file.
    assert records(work / "resumed") == records(work / "a")
    assert run_figures(work / "a") == run_figures(work / "resumed")
    return work


def run_figures(run: Path) -> dict:
    """summary.json's figures of the whole run (timing and memory aside): the
    final metrics, and the counts over every training batch (a resumed run
    reported its dedup ratios and training-batch CTR over the batches after
    the resume only)."""
    summary = json.loads((run / "summary.json").read_text())
    return {k: summary[k] for k in ("steps", "samples", "final", "duplication", "train_calibration")}


SHARDED = ["trainer.nproc=2", "placement.sharding=row", "placement=lookahead", "precision=int8",
           "placement.cache_ratio=0.05", "optimizer=adagrad", "dedup=on", "trainer.batch_size=64"]


@pytest.mark.slow  # several processes
def test_sharded_row_wise_lookahead_int8_adagrad_dedup_resumes_exactly_after_sigterm(tmp_path):
    """Every rank's shards and caches in the final checkpoint, after SIGTERM to
    both processes + resume, the same as the uninterrupted run's, tensor for
    tensor. (kill -9 of the same sharded run: the verify twin below; kill -9
    of two processes in `make test`: test_disk_cli's cache_avg run,
    test_distributed's killed worker, test_multinode's lost node.)"""
    # 60 steps (not the kill -9 twin's 120): the signal lands after step 10's log line, the resumed part
    # still crosses a checkpoint (30) and an evaluation (every 30 here); 6 s less of 2 processes
    common = [c for c in COMMON if not c.startswith("trainer.eval_every=")] + ["trainer.eval_every=30"]
    args = [*SMALL, *common, "trainer.max_steps=60", *SHARDED]
    work = tmp_path / "work"
    work.mkdir()
    recsys(args, work, "a")
    sigterm_then_resume(work, args, steps=60)


@pytest.mark.slow
@pytest.mark.verify  # two more 2-process launches: the suite's time
def test_sharded_row_wise_lookahead_int8_adagrad_dedup_resumes_exactly_after_kill_9(tmp_path):
    check_combination(tmp_path, SHARDED, steps=120, twice=False)


def test_lookahead_int8_small_cache_is_reproducible_and_resumes_exactly(tmp_path):
    # 0.05 of the small data's rows is less than one batch's unique rows: the store serves the rest.
    check_combination(tmp_path, ["+placement=lookahead", "+precision=int8", "placement.cache_ratio=0.05",
                                 "trainer.batch_size=64"], steps=120)


@pytest.mark.verify
@pytest.mark.parametrize("args", [
    ["+placement=lookahead", "+precision=int4", "placement.cache_ratio=0.05"],
    ["+placement=cache", "+precision=int8", "placement.cache_ratio=0.05", "precision.policy=lfu"],
    ["+placement=auto", "+precision=int8", "placement.device_memory_budget=300KiB"],
    pytest.param(["+placement=lookahead", "trainer.nproc=2", "trainer.embedding_sync=cache_avg", "trainer.sync_every=3",
                 "placement.cache_ratio=0.2"], marks=pytest.mark.slow),
    pytest.param(["dataset=synthetic_sessions", "+placement=lookahead", "+precision=int8", "trainer.nproc=2",
                 "placement.cache_ratio=0.05", "optimizer=adagrad", "+dedup=on"], marks=pytest.mark.slow),
    pytest.param(["trainer.nproc=2", "placement.sharding=table", "placement=disk", "placement.host_cache_rows=16",
                  "placement.cache_ratio=0.2"], marks=pytest.mark.slow),
    pytest.param(["trainer.nproc=2", "placement.sharding=auto", "placement=host", "precision=fp32"],
                 marks=pytest.mark.slow),
], ids=["lookahead-int4", "cache-int8-lfu", "auto-int8", "cache_avg-2proc", "grad-2proc-int8-adagrad-dedup",
        "sharded-table-disk-2proc", "sharded-auto-host-2proc"])
def test_combination_is_reproducible_and_resumes_exactly(tmp_path, args):
    check_combination(tmp_path, [*args, "trainer.batch_size=64"], steps=150)


@pytest.mark.verify
def test_the_issues_command_on_the_default_data(tmp_path):
    """`recsys train +placement=lookahead +precision=int8 placement.cache_ratio=0.01`, shortened."""
    check_combination(tmp_path, ["+placement=lookahead", "+precision=int8", "placement.cache_ratio=0.01"],
                      steps=200, data=[])


def sigterm_then_resume(work: Path, args: list[str], steps: int) -> int:
    """With run "a" of `args` already in `work`, run `args` again with a
    SIGTERM to the recsys process once its first log line is out ("term");
    resume that run and check it ends where "a" does, tensor for tensor. The
    step it stopped at."""
    env = {**os.environ, "RECSYS_CACHE": str(work.parent / "cache")}
    proc = subprocess.Popen([RECSYS, "train", *args, "hydra.run.dir=term"], cwd=work, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = work / "term" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]  # preemption.EXIT_STATUS
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr[-3000:]  # rank 0's, if several
    stopped = json.loads((work / "term" / "checkpoints" / "latest.json").read_text())["step"]
    assert 10 <= stopped < steps, "the run finished before the signal"
    assert stderr.strip() == (f"preempted: SIGTERM: stopped after step {stopped} of {steps} and saved "
                              f"{work / 'term' / 'checkpoints' / f'step-{stopped:08d}.pt'}; continue with "
                              "trainer.resume=true (same overrides)")
    assert not (work / "term" / "summary.json").exists()  # the run did not finish
    recsys([*args, "trainer.resume=true"], work, "term")
    assert_identical(final_checkpoint(work / "a", steps), final_checkpoint(work / "term", steps))
    assert run_figures(work / "a") == run_figures(work / "term")
    assert records(work / "term") == records(work / "a")
    return stopped


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(tmp_path):
    """SIGTERM killed the run at once, losing the work since the last checkpoint
    (issue 27). Lookahead + int8 behind a small cache: the checkpoint at the
    step the prefetcher had not yet filled past resumes bit for bit. (Two
    processes: the sharded test above.)"""
    steps = 50
    args = [*SMALL, *COMMON, "trainer.checkpoint_every=100000", f"trainer.max_steps={steps}", "+placement=lookahead",
            "+precision=int8", "placement.cache_ratio=0.05", "trainer.batch_size=64"]
    work = tmp_path / "work"
    work.mkdir()
    recsys(args, work, "a")
    sigterm_then_resume(work, args, steps)


SIGTERM_TWICE = """
import os, signal, sys, time
from recsys_cli.train.preemption import DUPLICATE_S, SigtermFlag
with SigtermFlag() as flag:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the same preemption delivered twice (scheduler and torchrun): one
    time.sleep(0.05)
    print("flagged" if flag.requested else "missed", flush=True)
    time.sleep(DUPLICATE_S + 0.1)
    os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM: the process ends at once
    time.sleep(30)
    print("survived", flush=True)
"""


def test_a_second_sigterm_exits_at_once():
    started = time.time()
    r = subprocess.run([sys.executable, "-c", SIGTERM_TWICE], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.split() == ["flagged"]
    assert time.time() - started < 20
