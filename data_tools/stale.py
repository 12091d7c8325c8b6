"""Removing what dead processes left: the one implementation.

A process killed with SIGKILL cannot clean up, so whatever it was building
(a dataset's `<output>.tmp-<pid>`, a predict's `.<name>.tmp-<pid>`, a disk
table's `recsys-disk-*` directory, a launcher's `recsys-launch-<pid>-*`
scratch directory) stays where it was. The next run of the tool that makes
such names removes them, by `remove_dead`, under one rule:

* only names this tool makes: the caller's pattern, matched against the
  whole name;
* only a dead process's: the pid the name (or `pid_of`) gives is not this
  process and no process has it now (a pid another user's process has is
  alive: `os.kill` says so with a PermissionError);
* only the current user's entries, and never through a symlink: an entry is
  judged by `lstat`, a symlink is never a directory (so never descended
  into), and it is removed, as a link, only where the caller removes files.

data_tools is below recsys_cli (tests/test_imports.py): recsys_cli's
callers (locks.py, embeddings/disk_store.py, train/distributed.py) import
this module, never the other way round.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (ours or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead(parent: str | os.PathLike, pattern: str, *, files: bool = False,
                pid_of: Callable[[Path], int] | None = None) -> list[Path]:
    """Remove the entries of `parent` whose name fullmatches `pattern` and
    whose process is dead; returns what was removed.

    The pid is the pattern's first group, or `pid_of(path)` for names that do
    not carry it (an entry it raises OSError or ValueError for is kept).
    Directories are removed with what they hold; other entries (files,
    symlinks, as links) only with `files=True`. Entries of other users, of
    this process or of a live one are kept; a `parent` that is not a
    directory has nothing to remove."""
    names = re.compile(pattern, re.S)
    try:
        entries = list(os.scandir(str(parent)))
    except OSError:
        return []
    removed = []
    for entry in entries:
        m = names.fullmatch(entry.name)
        if m is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        is_dir = stat.S_ISDIR(st.st_mode)
        if st.st_uid != os.getuid() or not (is_dir or files):
            continue
        path = Path(entry.path)
        try:
            pid = pid_of(path) if pid_of is not None else int(m.group(1))
            if pid == os.getpid() or pid_alive(pid):
                continue
        except (OSError, ValueError, OverflowError):
            continue  # unreadable, or no pid a process can have: not ours to judge
        if is_dir:
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        removed.append(path)
    return removed
