"""One run per run directory: an exclusive lock, taken before anything is
written, and no new run into a directory that holds another run's record.

Two `recsys train` in one run directory would interleave metrics.jsonl and mix
their checkpoints. The lock is recsys_cli/locks.py's, on `<dir>/.lock`, the
one every writing command takes: the kernel drops it when the holder exits
or dies, so a lock left by a killed run is stale by construction, and the
file is removed when the run ends.

A run that finished (or was killed) leaves metrics.jsonl, summary.json and
checkpoints; a second run into the same directory without trainer.resume
would replace them without a word, so `refuse_reuse` stops it first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Set as AbstractSet
from pathlib import Path

from recsys_cli import locks
from recsys_cli.errors import UserError

LOCK_NAME = locks.LOCK_NAME


@contextlib.contextmanager
def locked(directory: Path, what: str = "run directory") -> Iterator[None]:
    """Hold the lock on `directory` (created if needed) for the block; a
    UserError naming the holder when another process has it (locks.py: the
    one lock every writing command takes)."""
    key = "hydra.run.dir" if what == "run directory" else "trainer.checkpoint_dir"
    with locks.locked_dir(directory, what, "train", f"directory ({key}=DIR)"):
        yield


# What a run leaves that a new run would overwrite: its metrics, its summary, its checkpoints.
RECORDS = ("metrics.jsonl", "summary.json")
CHECKPOINTS = ("latest.json", "step-*.pt")


def holds_checkpoints(directory: Path) -> bool:
    return any(any(directory.glob(pattern)) for pattern in CHECKPOINTS)


def refuse_reuse(run_dir: Path, checkpoint_dir: Path | None) -> None:
    """UserError when a new run (no trainer.resume) would write into a run
    directory, or a checkpoint directory, that another run's record is in."""
    checkpoint_dir = checkpoint_dir or run_dir / "checkpoints"
    # An empty metrics.jsonl is a run that failed before its first log line: nothing to lose.
    found = [name for name in RECORDS if (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0]
    checkpoints = holds_checkpoints(checkpoint_dir)
    if found:
        held = found + ([checkpoint_dir.name + "/"] if checkpoints and checkpoint_dir.parent == run_dir else [])
        what = f"run directory {run_dir} holds another run ({', '.join(held)})"
    elif checkpoints:
        what = f"checkpoint directory {checkpoint_dir} holds another run's checkpoints"
    else:
        return
    raise UserError(f"{what}: resume it with trainer.resume=true, or choose another directory "
                    "(hydra.run.dir=DIR); nothing was changed")


def refuse_resume_into_another_run(run_dir: Path, checkpoint_dir: Path | None, checkpoint: Path) -> None:
    """A resume writes its run's metrics.jsonl, summary.json and checkpoints
    into `run_dir`: in place when `checkpoint` is that run's own (in its
    checkpoint directory), else into a directory that holds no other run.
    trainer.resume=OTHER_RUN's checkpoint with hydra.run.dir=A_FINISHED_RUN
    replaced that run's metrics, summary and its checkpoint of the same step
    without a word; it is a UserError naming both, and nothing is changed."""
    own = (checkpoint_dir or run_dir / "checkpoints").resolve()
    if checkpoint.resolve().parent == own:
        return
    try:
        refuse_reuse(run_dir, checkpoint_dir)
    except UserError as e:
        what = str(e).split(": resume it with", 1)[0]
        raise UserError(f"{what}, and a resume of {checkpoint}, another run's checkpoint, would replace them: "
                        "resume it into a new run directory (leave hydra.run.dir out, or name an unused one); "
                        "nothing was changed") from None


# What a start writes before the run has any output of its own: the lock, the
# composed config, Hydra's job log (empty until the first log line) and an
# empty metrics.jsonl.
START_FILES = (LOCK_NAME, ".hydra", "app.log", "metrics.jsonl")


def _holds_output(directory: Path) -> bool:
    for entry in directory.iterdir():
        if entry.name not in START_FILES:
            return True
        if entry.is_file() and entry.name != LOCK_NAME and entry.stat().st_size > 0:
            return True
    return False


def existing_dirs(overrides: list[str]) -> set[Path]:
    """Before Hydra runs: the directories named by hydra.run.dir= / hydra.sweep.dir=
    overrides, and their ancestors, that exist already (the user's, not ours)."""
    out: set[Path] = set()
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and value:
            path = Path(value).expanduser().resolve()
            out.update(p for p in (path, *path.parents) if p.is_dir())
    return out


def unused_dirs(run_dir: Path, stop: Path, existing: AbstractSet[Path] = frozenset()) -> list[Path]:
    """Called as a run starts: the run directory and the ancestors strictly
    below `stop` (the working directory) that hold nothing but the path to it
    and were not in `existing` before Hydra ran, i.e. what Hydra has just
    created for this run. Empty when the run directory held anything already
    (another run's, or the user's)."""
    run_dir, stop = run_dir.resolve(), stop.resolve()
    if (not run_dir.is_dir() or run_dir in existing or not run_dir.is_relative_to(stop) or run_dir == stop
            or _holds_output(run_dir) or (run_dir / LOCK_NAME).exists() or (run_dir / ".hydra").exists()):
        return []
    created = [run_dir]
    child = run_dir
    for parent in run_dir.parents:
        if parent == stop or parent in existing or not parent.is_relative_to(stop):
            break
        if [e.name for e in parent.iterdir()] != [child.name]:
            break
        created.append(parent)
        child = parent
    return created


def remove_unused(created: list[Path]) -> None:
    """After a failed start: remove the directories `unused_dirs` found, if the
    run wrote no output into them (only its lock, config and empty logs)."""
    if not created or not created[0].is_dir() or _holds_output(created[0]):
        return
    import shutil

    for name in START_FILES:
        path = created[0] / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    for directory in created:
        try:
            directory.rmdir()  # only if empty: a directory something else wrote into stays
        except OSError:
            return
