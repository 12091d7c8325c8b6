"""Chaos soak (issue 40 item 6): one training run through many random faults.

    .venv/bin/python -m bench.chaos_soak [--scenario single|sharded|both] [--faults 20] [--steps N]
        [--seed S] [--no-full-disk] [--keep DIR] [--record]

For each scenario, the same `recsys train` command runs twice in one working
directory: once uninterrupted (run dir `ref`) and once (`chaos`) through at
least `--faults` faults, each followed by `trainer.resume=true
hydra.run.dir=chaos` (a resume in place), until the run completes:

* kill9: SIGKILL to the whole process group at a random moment;
* kill9-checkpoint: SIGKILL the moment a checkpoint's temporary file or shard
  directory (`.step-*.tmp`) appears, i.e. during its write;
* kill9-eval: SIGKILL the moment app.log says a validation began and before
  it says it ended, i.e. during an evaluation;
* sigterm: SIGTERM to the process group (a scheduler's preemption): the run
  should save and exit 143;
* kill9-rank (sharded): SIGKILL one worker process only; the launcher should
  stop the other and exit;
* full-disk (once, unless --no-full-disk; needs root): the checkpoint
  directory is a small tmpfs (mounted on chaos/checkpoints); the soak fills it
  so the next checkpoint cannot fit (--disk-free: the fraction of one left
  free), waits for the run to stop, records what the user saw (exit
  status, one `error:` line or a traceback), frees the space and resumes.

Each fault is armed only once the run has written a checkpoint newer than the
one it resumed from, so every attempt makes progress. At the end: the final
checkpoint of `chaos` equals `ref`'s tensor for tensor (torch.equal, the
helpers of tests/test_resume_exact.py), metrics.jsonl and summary.json's
final metrics are the same, `recsys verify input=chaos` passes, no temporary file
(a name with `.tmp`) is left in the run directory, and no `.lock` there is
still held (the lock file stays by design, recsys_cli/train/rundir.py: the
kernel drops a dead holder's flock). Steps redone = for each fault, the last
step logged before it minus the step the next attempt resumed from.

Scenarios: `single` = one process, placement=lookahead, precision=int8,
a cache smaller than one batch; `sharded` = trainer.nproc=2, row-wise
sharding, lookahead + int8, Adagrad, dedup (tests/test_resume_exact.py's two).
--record appends a row per scenario to BENCHMARKS.md ("Chaos soak").
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECSYS = str(Path(sys.executable).with_name("recsys"))
SMALL = ["dataset.synthetic.rows=20000", "dataset.synthetic.cardinality_scale=0.0005"]
# checkpoints every 20 steps, evaluations every 50 (not at a checkpoint step but every 100th), lines every 10
COMMON = ["trainer.progress=false", "trainer.checkpoint_every=20", "trainer.log_every=10", "trainer.eval_every=50",
          "trainer.batch_size=64", "trainer.epochs=100"]  # max_steps ends the run, not the small data's epoch
SCENARIOS = {
    "single": ["+placement=lookahead", "+precision=int8", "placement.cache_ratio=0.05"],
    "sharded": ["trainer.nproc=2", "placement.sharding=row", "placement=lookahead", "precision=int8",
                "placement.cache_ratio=0.05", "optimizer=adagrad", "dedup=on"],
}
EVAL_START = re.compile(r"eval val at step (\d+): [\d,]+ rows")
WAIT_S = 300  # the longest an attempt may take to stop after a fault (SIGTERM, a dead rank, a full disk)


@dataclass
class Fault:
    kind: str
    attempt: int
    resumed_from: int = 0
    last_logged: int = 0
    landed: str = ""  # what the fault hit (checkpoint write seen, eval seen, ...)
    exit_code: int | None = None
    error_lines: list[str] = field(default_factory=list)
    traceback: bool = False
    seconds_to_exit: float = 0.0


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def env_for(work: Path) -> dict:
    return {**os.environ, "RECSYS_CACHE": str(work / "cache"), "COLUMNS": "200"}


def train_cmd(args: list[str], run: str, resume: bool) -> list[str]:
    return [RECSYS, "train", *args, f"hydra.run.dir={run}", *(["trainer.resume=true"] if resume else [])]


def checkpoints(run: Path) -> Path:
    return run / "checkpoints"


def latest_step(run: Path) -> int:
    try:
        return int(json.loads((checkpoints(run) / "latest.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        steps = [int(p.name[5:13]) for p in checkpoints(run).glob("step-*.pt")]
        return max(steps, default=0)


def last_logged_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(ln).get("step", 0) for ln in lines if ln.strip()]
    return max(steps, default=0)


def tmp_entries(directory: Path) -> list[str]:
    try:
        return [e.name for e in os.scandir(directory) if ".tmp" in e.name]
    except OSError:
        return []


def workers(pid: int) -> list[int]:
    """The launcher's rank processes (trainer.nproc=2's spawned workers; not
    multiprocessing's resource tracker, also a child: killing that one is no
    lost rank, the run goes on)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                cmdline = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid and b"spawn_main" in cmdline:
                out.append(int(d))
    return out


def killpg(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


@contextlib.contextmanager
def tmpfs(path: Path, size: int, enabled: bool):
    """A tmpfs of `size` bytes on `path` (root only); yields whether it is mounted."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = False
    if enabled:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                           text=True)
        mounted = r.returncode == 0
        if not mounted:
            log(f"no full-disk fault: cannot mount a tmpfs on {path} ({r.stderr.strip()}); run as root")
    try:
        yield mounted
    finally:
        if mounted:
            for _ in range(20):
                if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.5)


class Soak:
    def __init__(self, work: Path, name: str, args: list[str], faults: int, seed: int, full_disk: bool,
                 disk_free: float = 1 / 3):
        self.work, self.name, self.args = work, name, args
        self.disk_free = disk_free  # the full disk leaves this fraction of a checkpoint free
        self.rng = random.Random(seed)
        self.run = work / "chaos"
        self.plan = self._plan(faults, name == "sharded", full_disk)
        self.faults: list[Fault] = []
        self.attempt = 0
        self.mounted = False

    def _plan(self, n: int, sharded: bool, full_disk: bool) -> list[str]:
        kinds = ["kill9", "kill9-checkpoint", "kill9-eval", "sigterm"] + (["kill9-rank"] if sharded else [])
        weights = {"kill9": 3, "kill9-checkpoint": 2, "kill9-eval": 2, "sigterm": 1, "kill9-rank": 1}
        plan = list(kinds)  # each kind at least once
        plan += self.rng.choices(kinds, [weights[k] for k in kinds], k=max(0, n - len(kinds) - int(full_disk)))
        self.rng.shuffle(plan)
        if full_disk:  # once, a third of the way in (there are checkpoints to keep by then)
            plan.insert(len(plan) // 3, "full-disk")
        return plan

    # --- one attempt ---------------------------------------------------------------------------------------
    def start(self) -> tuple[subprocess.Popen, int, int]:
        resume = latest_step(self.run) > 0
        resumed_from = latest_step(self.run)
        self.attempt += 1
        out = open(self.work / f"{self.name}-attempt-{self.attempt:02d}.log", "w")
        app_log = self.run / "app.log"
        offset = app_log.stat().st_size if app_log.exists() else 0
        proc = subprocess.Popen(train_cmd(self.args, "chaos", resume), cwd=self.work, env=env_for(self.work),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        return proc, resumed_from, offset

    def attempt_log(self) -> str:
        return (self.work / f"{self.name}-attempt-{self.attempt:02d}.log").read_text(errors="replace")

    def wait_progress(self, proc: subprocess.Popen, resumed_from: int) -> bool:
        """Until a checkpoint newer than the one resumed from exists; False if the run ended first."""
        while latest_step(self.run) <= resumed_from:
            if proc.poll() is not None:
                return False
            time.sleep(0.01)
        return True

    def inject(self, kind: str) -> Fault | None:
        proc, resumed_from, app_offset = self.start()
        fault = Fault(kind, self.attempt, resumed_from)
        if not self.wait_progress(proc, resumed_from):
            self._ended_early(proc, fault)
            return None
        ckpt = checkpoints(self.run)
        t_fault = time.time()
        if kind == "kill9":
            time.sleep(self.rng.uniform(0, 1.5))
            fault.last_logged = last_logged_step(self.run)
            killpg(proc, signal.SIGKILL)
            fault.landed = f"{len(tmp_entries(ckpt))} temporary checkpoint entries at the kill"
        elif kind == "kill9-checkpoint":
            while not tmp_entries(ckpt):
                if proc.poll() is not None:
                    self._ended_early(proc, fault)
                    return None
                time.sleep(0.0005)
            fault.last_logged = last_logged_step(self.run)
            killpg(proc, signal.SIGKILL)
            fault.landed = "during a checkpoint write: " + ", ".join(tmp_entries(ckpt) or ["(write had ended)"])
        elif kind == "kill9-eval":
            app_log = self.run / "app.log"
            step = None
            while step is None:
                if proc.poll() is not None:
                    self._ended_early(proc, fault)
                    return None
                with contextlib.suppress(OSError):
                    with open(app_log, "rb") as f:
                        f.seek(app_offset)
                        text = f.read().decode(errors="replace")
                    starts = EVAL_START.findall(text)
                    if starts and f"eval val at step {starts[-1]}: AUC" not in text:
                        step = int(starts[-1])
                        break
                time.sleep(0.001)
            fault.last_logged = last_logged_step(self.run)
            killpg(proc, signal.SIGKILL)
            ended = f"eval val at step {step}: AUC" in app_log.read_text(errors="replace")[app_offset:]
            fault.landed = f"eval at step {step} " + ("had ended" if ended else "in progress")
        elif kind == "sigterm":
            time.sleep(self.rng.uniform(0, 1.5))
            fault.last_logged = last_logged_step(self.run)
            killpg(proc, signal.SIGTERM)
        elif kind == "kill9-rank":
            time.sleep(self.rng.uniform(0, 1.5))
            ranks = workers(proc.pid)
            fault.last_logged = last_logged_step(self.run)
            if not ranks:
                killpg(proc, signal.SIGKILL)
                fault.landed = "no worker found: the group killed"
            else:
                victim = self.rng.choice(ranks)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                fault.landed = f"worker pid {victim} of {len(ranks)}"
        elif kind == "full-disk":
            fault.landed = self._fill(ckpt)
        code = wait(proc, WAIT_S)
        if code is None:
            fault.landed += f"; still running {WAIT_S} s after the fault: killed"
            killpg(proc, signal.SIGKILL)
            code = proc.wait()
        if kind == "full-disk":
            (ckpt / "filler").unlink(missing_ok=True)
        fault.seconds_to_exit = round(time.time() - t_fault, 2)
        fault.exit_code = code
        if not fault.last_logged:
            fault.last_logged = last_logged_step(self.run)
        text = self.attempt_log()
        fault.error_lines = [ln.replace(str(self.work), "WORK") for ln in text.splitlines()
                             if ln.startswith("error:") or "preempted" in ln][:3]
        fault.traceback = "Traceback" in text
        log(f"{self.name} fault {len(self.faults) + 1} {kind}: exit {code}, resumed from {resumed_from}, "
            f"logged {fault.last_logged}, now at {latest_step(self.run)}; {fault.landed} "
            f"{fault.error_lines[:1]}{' TRACEBACK' if fault.traceback else ''}")
        return fault

    def _fill(self, ckpt: Path) -> str:
        """Leave less free space than a checkpoint needs; wait for the run to stop on it."""
        if not self.mounted:
            return "no tmpfs (not root): skipped"
        free = shutil.disk_usage(ckpt).free
        leave = max(4096, int(self.ckpt_bytes * self.disk_free))
        with open(ckpt / "filler", "wb") as f:
            with contextlib.suppress(OSError):
                f.write(b"\0" * max(0, free - leave))
        return f"tmpfs filled to {shutil.disk_usage(ckpt).free} bytes free (a checkpoint is {self.ckpt_bytes})"

    def _ended_early(self, proc: subprocess.Popen, fault: Fault) -> None:
        code = proc.wait()
        log(f"{self.name}: the run ended (exit {code}) before fault {fault.kind} could be injected")
        if code != 0:
            raise SystemExit(f"{self.name}: attempt {self.attempt} failed on its own (exit {code}):\n"
                             + self.attempt_log()[-3000:])

    # --- the whole soak -------------------------------------------------------------------------------------
    def go(self, steps: int, full_disk: bool) -> dict:
        args = self.args
        t0 = time.time()
        log(f"{self.name}: the uninterrupted run ({steps} steps)")
        r = subprocess.run(train_cmd(args, "ref", False), cwd=self.work, env=env_for(self.work), capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise SystemExit(f"{self.name}: the uninterrupted run failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
        ref_seconds = time.time() - t0
        ref_ckpt = checkpoints(self.work / "ref")
        per = sorted(ref_ckpt.glob("step-*.pt"))[-1]
        self.ckpt_bytes = sum(p.stat().st_size for p in ref_ckpt.rglob("*") if p.is_file()
                              and (p.name.startswith(per.stem) or per.stem in str(p.parent)))
        size = max(1 << 20, 4 * self.ckpt_bytes + (1 << 20))
        with tmpfs(checkpoints(self.run), size, full_disk) as mounted:
            self.mounted = mounted
            for kind in self.plan:
                fault = self.inject(kind)
                if fault is None:
                    break
                self.faults.append(fault)
            log(f"{self.name}: {len(self.faults)} faults; the last attempt runs to the end")
            proc, resumed_from, _ = self.start()
            code = wait(proc, 1800)
            if code != 0:
                raise SystemExit(f"{self.name}: the final attempt failed (exit {code}):\n{self.attempt_log()[-3000:]}")
            result = self.check(steps)
        result.update(self.summary(time.time() - t0, ref_seconds))
        return result

    def check(self, steps: int) -> dict:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_resume_exact import assert_identical, final_checkpoint, records

        ref, chaos = self.work / "ref", self.run
        out: dict = {}
        try:
            assert_identical(final_checkpoint(ref, steps), final_checkpoint(chaos, steps))
            out["checkpoint equal"] = "yes"
        except AssertionError as e:
            out["checkpoint equal"] = f"NO: {str(e)[:300]}"
        out["metrics.jsonl equal"] = "yes" if records(ref) == records(chaos) else "NO"
        final = lambda run: json.loads((run / "summary.json").read_text())["final"]  # noqa: E731
        out["final metrics equal"] = "yes" if final(ref) == final(chaos) else "NO"
        v = subprocess.run([RECSYS, "verify", f"input={chaos}"], cwd=self.work, env=env_for(self.work), capture_output=True,
                           text=True)
        out["verify"] = "passes" if v.returncode == 0 else f"exit {v.returncode}: {v.stderr.strip()[-300:]}"
        leftovers = sorted(str(p.relative_to(chaos)) for p in chaos.rglob("*") if ".tmp" in p.name)
        out["temporary files left"] = leftovers
        held = []
        for lock in chaos.rglob(".lock"):
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(str(lock.relative_to(chaos)))
            finally:
                os.close(fd)
        out["locks held"] = held
        return out

    def summary(self, seconds: float, ref_seconds: float) -> dict:
        kinds: dict[str, int] = {}
        for f in self.faults:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        redone = 0
        for i, f in enumerate(self.faults):
            after = self.faults[i + 1].resumed_from if i + 1 < len(self.faults) else None
            if after is not None:
                redone += max(0, f.last_logged - after)
        disk = [f for f in self.faults if f.kind == "full-disk"]
        disk_text = "not run"
        if disk:
            d = disk[0]
            disk_text = (f"exit {d.exit_code}, " + ("a traceback" if d.traceback else "no traceback") + ", "
                         + (f"{len(d.error_lines)} error line(s): {d.error_lines[0][:240]}" if d.error_lines
                            else "no error: line") + f" ({d.landed})")
        return {
            "faults": len(self.faults), "by kind": ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())),
            "attempts": self.attempt, "steps redone": redone, "full disk": disk_text,
            "sigterm exits": sorted({f.exit_code for f in self.faults if f.kind == "sigterm"}),
            "kill9-rank exits": sorted({f.exit_code for f in self.faults if f.kind == "kill9-rank"}),
            "checkpoint kills mid-write": sum(1 for f in self.faults if f.kind == "kill9-checkpoint"
                                              and "write had ended" not in f.landed),
            "eval kills mid-eval": sum(1 for f in self.faults if f.kind == "kill9-eval" and "in progress" in f.landed),
            "seconds": round(seconds), "uninterrupted seconds": round(ref_seconds),
            "faults detail": [f.__dict__ for f in self.faults],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=["single", "sharded", "both"], default="both")
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--steps", type=int, default=0, help="training steps (default: 50 per fault)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-full-disk", dest="full_disk", action="store_false")
    ap.add_argument("--disk-free", type=float, default=1 / 3,
                    help="the full disk leaves this fraction of a checkpoint's bytes free (default 1/3): where "
                         "in the write the disk runs out")
    ap.add_argument("--keep", type=Path, default=None, help="work in this directory and keep it")
    ap.add_argument("--record", action="store_true")
    opts = ap.parse_args()
    steps = opts.steps or 50 * opts.faults
    names = ["single", "sharded"] if opts.scenario == "both" else [opts.scenario]
    results = {}
    load0 = os.getloadavg()
    for name in names:
        work = (opts.keep / name) if opts.keep else Path(tempfile.mkdtemp(prefix=f"chaos-{name}-"))
        work.mkdir(parents=True, exist_ok=True)
        args = [*SMALL, *COMMON, f"trainer.max_steps={steps}", *SCENARIOS[name]]
        try:
            soak = Soak(work, name, args, opts.faults, opts.seed, opts.full_disk, opts.disk_free)
            results[name] = soak.go(steps, opts.full_disk)
        finally:
            if not opts.keep:
                shutil.rmtree(work, ignore_errors=True)
        detail = results[name].pop("faults detail")
        print(json.dumps({name: results[name]}, indent=1, default=str))
        (Path(tempfile.gettempdir()) / f"chaos-{name}-faults.json").write_text(json.dumps(detail, indent=1))
    load1 = os.getloadavg()
    ok = all(r["checkpoint equal"] == "yes" and r["metrics.jsonl equal"] == "yes" and not r["temporary files left"]
             and not r["locks held"] and r["verify"] == "passes" and r["faults"] >= opts.faults
             for r in results.values())
    if opts.record:
        from bench.record import record

        rows = [{"scenario": n, "faults survived": r["faults"], "by kind": r["by kind"],
                 "final checkpoint equal": r["checkpoint equal"], "metrics equal": r["metrics.jsonl equal"],
                 "temporary files or held locks left": len(r["temporary files left"]) + len(r["locks held"]),
                 "steps redone": r["steps redone"], "full disk": r["full disk"], "soak s": r["seconds"],
                 "load (1 min) start/end": f"{load0[0]:.1f}/{load1[0]:.1f}"} for n, r in results.items()]
        argv = " ".join(sys.argv[1:])
        record("Chaos soak", list(rows[0]), rows, f"python -m bench.chaos_soak {argv}".strip(),
               note="bench/chaos_soak.py (`make chaos`): one run through random kill -9 (at random moments, during "
                    "checkpoint writes, during evaluations), SIGTERM, a killed rank (sharded) and a full disk "
                    "(a tmpfs checkpoint directory), resuming in place after each; the final checkpoint compared "
                    "with the uninterrupted run's tensor for tensor.")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
