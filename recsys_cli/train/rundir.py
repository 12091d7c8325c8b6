"""One run per run directory: an exclusive lock, taken before anything is written.

Two `recsys train` in one run directory would interleave metrics.jsonl and mix
their checkpoints. The lock is `fcntl.flock` on `<dir>/.lock`: the kernel drops
it when the holder exits or dies, so a lock left by a killed run is stale by
construction (the file stays, holding the last holder's pid for the message).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from recsys_cli.errors import UserError

LOCK_NAME = ".lock"


@contextlib.contextmanager
def locked(directory: Path, what: str = "run directory") -> Iterator[None]:
    """Hold the lock on `directory` (created if needed) for the block; a
    UserError naming the holder's pid when another process has it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"cannot use {what} {directory}: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise UserError(
                f"{what} {directory} is in use by another recsys train (pid {holder}); "
                "wait for it to end or choose another directory (hydra.run.dir=DIR)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
