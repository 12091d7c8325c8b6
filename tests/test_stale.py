"""data_tools/stale.py: what dead processes left is removed by the next run,
and nothing else (a live pid's, a name the caller does not make, what a
symlink points to)."""

from __future__ import annotations

import os
import subprocess
import sys

from data_tools.stale import pid_alive, remove_dead


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_pid_alive():
    assert pid_alive(os.getpid()) and pid_alive(1)  # pid 1: always there
    assert not pid_alive(dead_pid())


def test_only_dead_pids_of_names_the_caller_makes_are_removed(tmp_path):
    dead = dead_pid()
    for name in [f"a.tmp-{dead}", f"a.tmp-{os.getpid()}", f"a.tmp-{os.getppid()}", f"b.tmp-{dead}"]:
        (tmp_path / name).mkdir()
    (tmp_path / f"a.tmp-{dead}" / "part").write_text("x")
    (tmp_path / f"a.tmp-{dead}0000000000000000000000").mkdir()  # no pid a process can have
    assert remove_dead(tmp_path, r"a\.tmp-([0-9]+)") == [tmp_path / f"a.tmp-{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"a.tmp-{os.getpid()}", f"a.tmp-{os.getppid()}", f"b.tmp-{dead}", f"a.tmp-{dead}0000000000000000000000"])


def test_files_only_when_asked_and_symlinks_are_never_followed(tmp_path):
    dead = dead_pid()
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("a user's")
    (tmp_path / f"f.tmp-{dead}").write_text("partial")
    (tmp_path / f"d.tmp-{dead}").symlink_to(target, target_is_directory=True)
    remove_dead(tmp_path, r"[fd]\.tmp-([0-9]+)")
    assert (tmp_path / f"f.tmp-{dead}").is_file() and (tmp_path / f"d.tmp-{dead}").is_symlink()
    remove_dead(tmp_path, r"[fd]\.tmp-([0-9]+)", files=True)  # the link goes, not what it points to
    assert not (tmp_path / f"f.tmp-{dead}").exists() and not (tmp_path / f"d.tmp-{dead}").is_symlink()
    assert (target / "keep").read_text() == "a user's"


def test_a_pid_from_a_file_in_the_directory(tmp_path):
    dead = dead_pid()
    for name, owner in [("x-1", str(dead)), ("x-2", str(os.getpid())), ("x-3", "garbage"), ("x-4", None)]:
        (tmp_path / name).mkdir()
        if owner is not None:
            (tmp_path / name / "owner.pid").write_text(owner)
    remove_dead(tmp_path, r"x-.*", pid_of=lambda p: int((p / "owner.pid").read_text()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-2", "x-3", "x-4"]
