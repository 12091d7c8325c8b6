"""One writer per output: the lock every writing command takes, and the
check that a place can be written at all.

Two commands writing the same output (two `recsys preprocess` into one
dataset directory, two `recsys train` into one run directory, a `predict`
into a file another `predict` is writing) would each say they wrote it while
the output holds one of them, or a mix. Every writer (train, preprocess,
predict, evaluate, export, report) therefore holds an exclusive lock on its
output for as long as it writes, and a second writer is refused in one line
naming the process that holds it (exit 2).

The lock is `fcntl.flock` on a lock file: the kernel drops it when the
holder exits or dies, so the lock of a killed process is stale by
construction and the next writer takes it over. The file holds the holder's
pid and command, for the message. It is removed when the writer ends (a
writer killed with SIGKILL leaves it, stale, for the next one to take
over). Removing a lock file races with a process that opened it just
before: after taking the lock a writer checks that the path still names the
file it locked, and starts again if not, so two writers never both hold a
lock on one path.

Where the lock file lives: `<dir>/.lock` for a directory the writer writes
into (a run directory, a checkpoint directory), `<parent>/.<name>.lock` for
an output that is built aside and renamed into place (a dataset directory, a
predictions file, an export artifact): a lock inside such an output would be
renamed away with it.

A writer killed mid-write leaves the `.<name>.tmp-<pid>` it built the
output in; the next writer of that output removes it once it holds the lock
(`remove_stale_temps`).

`check_writable` is the start-up check of a place the run will write: a
read-only file system or a directory the user may not write into is one
line naming the path (exit 2), before any work.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from recsys_cli.errors import UserError

LOCK_NAME = ".lock"


def lock_file_of(output: Path) -> Path:
    """The lock file of an output that is built aside and renamed into place."""
    return output.with_name(f".{output.name}.lock")


@contextlib.contextmanager
def locked_dir(directory: Path, what: str, command: str, hint: str = "") -> Iterator[None]:
    """Hold the lock of `directory` (created if needed) for the block."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write {what} {directory}: {e.strerror or e}") from None
    with _held(directory / LOCK_NAME, directory, what, command, hint):
        yield


@contextlib.contextmanager
def locked_output(output: Path, what: str, command: str, hint: str = "") -> Iterator[None]:
    """Hold the lock of `output` (a file or directory renamed into place) for
    the block; its parent directory is created if needed."""
    output = output.expanduser().absolute()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write {what} {output}: {e.strerror or e} ({output.parent})") from None
    with _held(lock_file_of(output), output, what, command, hint):
        remove_stale_temps(output)
        yield


def remove_stale_temps(output: Path) -> None:
    """Remove what writers of `output` killed mid-write left beside it: the
    file or folder `.<name>.tmp-<pid>` each builds the output in (a predict
    killed with SIGKILL left its partial CSV there for good). Called with the
    output's lock held, so no other recsys writer of this output is running;
    a temp of a live pid is still left alone (a writer of another kind that
    names its temps alike, e.g. a checkpoint being saved where output= points)."""
    import re

    from data_tools.stale import remove_dead

    remove_dead(output.parent, r"\." + re.escape(output.name) + r"\.tmp-([0-9]+)", files=True)


def holder_of(lock_file: Path) -> str:
    """`recsys COMMAND (pid N)` from a lock file's record (older records: the pid alone)."""
    try:
        words = lock_file.read_text(errors="replace").split()
    except OSError:
        words = []
    pid = words[0] if words else "?"
    command = words[1] if len(words) > 1 else "train"
    return f"recsys {command} (pid {pid})"


@contextlib.contextmanager
def _held(lock_file: Path, target: Path, what: str, command: str, hint: str) -> Iterator[None]:
    import fcntl

    while True:
        try:
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UserError(f"cannot write {what} {target}: {e.strerror or e} ({lock_file})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"{what} {target} is in use by another {holder_of(lock_file)}; wait for it to end or "
                            f"choose another {hint or what}") from None
        try:  # the holder before us may have removed the file between our open and our flock
            same = os.path.samestat(os.fstat(fd), os.stat(lock_file))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {command}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_file)  # while still held: a writer that opened it before starts again
        os.close(fd)  # releases the lock


def check_writable(path: Path, what: str) -> None:
    """UserError naming `path` when the run could not create or write it: the
    nearest existing directory at or above it refuses a new entry (a read-only
    file system, no permission). Creates nothing that stays."""
    path = path.expanduser().absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        if probe == path:  # an existing file: written in place or replaced beside it
            probe = path.parent
        else:
            raise UserError(f"cannot write {what} {path}: {probe} is not a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".recsys-probe-", dir=probe)
    except OSError as e:
        where = "" if probe == path else f" ({probe})"
        raise UserError(f"cannot write {what} {path}: {e.strerror or e}{where}") from None
    os.close(fd)
    os.unlink(name)



def check_not_read(output: Path, read: list[tuple[str, Path]], command: str) -> None:
    """UserError when `output` is a file the command reads: one of `read`
    ((what, path) pairs, e.g. ("input", path)), or, where that is a dataset
    directory, one of the files it is made of (its manifest, shards and
    vocabulary). The output replaces what it names: `recsys predict
    input=test.txt output=test.txt` put the predictions where the user's rows
    were, and output=DATASET/manifest.json broke the dataset."""
    from data_tools.dataset_dir import written_files

    out = output.expanduser().resolve()
    for what, path in read:
        p = path.expanduser().resolve()
        if out == p:
            where = "is"
        elif p in out.parents and p.is_dir() and out.relative_to(p).as_posix() in written_files(p):
            where = "is a file of"
        else:
            continue
        raise UserError(f"output {output} {where} the {what} {path} that `recsys {command}` reads; write it elsewhere")
