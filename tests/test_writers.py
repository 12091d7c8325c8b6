"""Every writer holds its output alone, and a place it cannot write is one line (issue 40 items 2, 3).

Locks (recsys_cli/locks.py): two `recsys preprocess` into one output both
said they wrote it while the output held one of them; now the second is
refused naming the first, the first's dataset verifies, a lock left by a
dead process is taken over, and no lock file stays behind.

Unwritable places: each case runs the command in a forked child whose mount
namespace has a directory bind-mounted read-only (we run as root, so a
chmod would not deny the write), and expects exit 2 with one `error:` line
naming the path, before any work.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from recsys_cli.cli import main
from recsys_cli.errors import UserError
from recsys_cli.locks import lock_file_of, locked_dir, locked_output

RECSYS = str(Path(sys.executable).with_name("recsys"))


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
        sys.exit(0)
    return e.value.code, capsys.readouterr().err


# --- item 2: locks ------------------------------------------------------------------------------------------------


def test_a_lock_is_exclusive_names_its_holder_and_is_removed_at_the_end(tmp_path):
    out = tmp_path / "data"
    with locked_output(out, "output", "preprocess"):
        assert lock_file_of(out).read_text() == f"{os.getpid()} preprocess\n"
        with pytest.raises(UserError, match=rf"output {out} is in use by another recsys preprocess \(pid {os.getpid()}\)"):
            with locked_output(out, "output", "predict"):
                pass
    assert not lock_file_of(out).exists()
    with locked_dir(tmp_path / "run", "run directory", "train"):  # taken again once released
        assert (tmp_path / "run" / ".lock").is_file()
    assert not (tmp_path / "run" / ".lock").exists()


def test_a_lock_removed_by_its_holder_is_not_taken_twice(tmp_path, monkeypatch):
    """A writer that opened the lock file just before its holder removed it
    locks the removed file: it must notice and lock the path anew, or two
    writers would hold 'the' lock."""
    from recsys_cli import locks

    out = tmp_path / "data"
    real_open = os.open
    opened = []

    def open_then_holder_ends(path, *args):
        fd = real_open(path, *args)
        if not opened:  # as if the holder unlinked the file right after our open
            opened.append(path)
            os.unlink(path)
        return fd

    monkeypatch.setattr(locks.os, "open", open_then_holder_ends)
    with locked_output(out, "output", "preprocess"):
        monkeypatch.setattr(locks.os, "open", real_open)
        assert lock_file_of(out).is_file()  # the path names the file this writer holds
        with pytest.raises(UserError, match="in use by another recsys preprocess"):
            with locked_output(out, "output", "preprocess"):
                pass


def test_two_concurrent_preprocess_runs_into_one_output(tmp_path, capsys):
    out = tmp_path / "data"
    args = ["preprocess", "synthetic", "rows=100000", "cardinality_scale=0.001", f"output={out}", "progress=false"]
    first = subprocess.Popen([RECSYS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = lock_file_of(out)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the first holds the lock (its pid written after the flock)
        if lock.is_file() and lock.read_text().startswith(f"{first.pid} "):
            break
        assert first.poll() is None, first.communicate()
        time.sleep(0.005)
    else:
        pytest.fail("the first preprocess never took its lock")
    os.kill(first.pid, signal.SIGSTOP)  # it holds the output for as long as the second one tries
    try:
        code, err = run_cli(args[:2] + ["rows=500", *args[3:]], capsys)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert code == 2
    assert one_error_line(err) == (f"error: output {out} is in use by another recsys preprocess (pid {first.pid}); "
                                   "wait for it to end or choose another output")
    _, first_err = first.communicate(timeout=120)
    assert first.returncode == 0, first_err
    code, err = run_cli(["verify", str(out)], capsys)
    assert code == 0, err
    from data_tools.manifest import load_manifest

    assert load_manifest(out).splits["train"].rows == 80000  # the first one's dataset, whole
    assert not lock.exists() and not list(tmp_path.glob("data.tmp-*"))


def test_a_stale_preprocess_lock_is_taken_over(tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    out = tmp_path / "data"
    lock_file_of(out).write_text(f"{dead.stdout.strip()} preprocess\n")  # left by a killed preprocess
    code, err = run_cli(["preprocess", "synthetic", "rows=500", "cardinality_scale=0.001", f"output={out}",
                         "progress=false"], capsys)
    assert code == 0, err
    assert (out / "manifest.json").is_file() and not lock_file_of(out).exists()


def test_predict_evaluate_export_and_report_refuse_a_held_output(tmp_path, capsys):
    """Each takes its output's lock before it writes, and says who holds it."""
    from train_config import config, train

    run = tmp_path / "run"
    train(config(tmp_path / "cache", trainer__max_steps=2, trainer__eval_every=None), run_dir=run)
    cases = [("predict", tmp_path / "p.csv", [f"input={run}", "split=val"]),
             ("evaluate", tmp_path / "ev", ["split=val"]),
             ("export", tmp_path / "m.pt2", [])]
    for command, output, extra in cases:
        with locked_output(output, "output", command):
            code, err = run_cli([command, f"checkpoint={run}", f"output={output}", *extra], capsys)
        assert code == 2, err
        assert f"output {output} is in use by another recsys {command} (pid {os.getpid()})" in one_error_line(err)
        assert not output.exists()
    runs = tmp_path / "runs"
    (runs / "r1").mkdir(parents=True)
    (runs / "r1" / "summary.json").write_text((run / "summary.json").read_text())
    with locked_output(runs / "report.csv", "report output", "report"):
        code, err = run_cli(["report", str(runs), "--no-plots"], capsys)
    assert code == 2 and f"is in use by another recsys report (pid {os.getpid()})" in one_error_line(err), err
    assert not (runs / "report.csv").exists()


# --- item 3: unwritable places ------------------------------------------------------------------------------------

CLONE_NEWNS, MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20000, 1, 32, 4096, 16384, 1 << 18
NO_NAMESPACE = 77  # the child could not make its mount namespace: not root, or no CAP_SYS_ADMIN


def in_read_only(read_only: list[Path], argv: list[str], env: dict[str, str], tmp_path: Path) -> tuple[int, str]:
    """`recsys ARGV` in a forked child whose own mount namespace has each of
    `read_only` bind-mounted read-only (the test's files stay writable for
    everyone else); returns the exit code and stderr."""
    err_file = tmp_path / f"stderr-{len(list(tmp_path.glob('stderr-*')))}"
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWNS) or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None):
                os._exit(NO_NAMESPACE)
            for path in read_only:
                p = str(path).encode()
                if libc.mount(p, p, None, MS_BIND, None) or libc.mount(
                        b"none", p, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None):
                    os._exit(NO_NAMESPACE)
            fd = os.open(err_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = open(2, "w", closefd=False)
            os.environ.update(env)
            os.chdir(tmp_path)  # a run directory the start made below it is removed when the start fails
            try:
                main(argv)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"recsys {' '.join(argv)} did not end within 120 s")
        time.sleep(0.02)
    code = os.waitstatus_to_exitcode(status)
    if code == NO_NAMESPACE:
        pytest.skip("needs a private mount namespace (root, CAP_SYS_ADMIN)")
    return code, err_file.read_text() if err_file.exists() else ""


@pytest.fixture
def places(tmp_path):
    ro = tmp_path / "ro"
    (ro / "cache").mkdir(parents=True)
    (tmp_path / "rw").mkdir()
    return ro, tmp_path / "rw", {"RECSYS_CACHE": str(tmp_path / "rw" / "cache"), "COLUMNS": "200"}


TINY = ["trainer.max_steps=2", "trainer.progress=false", "dataset.synthetic.rows=2000"]


def test_a_read_only_run_directory_is_one_line(places, tmp_path):
    """It was Hydra's traceback (OSError: [Errno 30] Read-only file system) from its makedirs."""
    ro, rw, env = places
    code, err = in_read_only([ro], ["train", f"hydra.run.dir={ro / 'run'}", *TINY], env, tmp_path)
    assert code == 2, err
    assert one_error_line(err) == f"error: cannot write run directory {ro / 'run'}: Read-only file system ({ro})"
    assert not (ro / "run").exists()


def test_a_read_only_checkpoint_directory_is_one_line_before_the_run_starts(places, tmp_path):
    ro, rw, env = places
    code, err = in_read_only([ro], ["train", f"hydra.run.dir={rw / 'run'}", f"trainer.checkpoint_dir={ro / 'ck'}",
                                    *TINY], env, tmp_path)
    assert code == 2, err
    assert one_error_line(err) == f"error: cannot write checkpoint directory {ro / 'ck'}: Read-only file system ({ro})"
    assert not (rw / "run").exists()  # refused before Hydra made the run directory


def test_a_read_only_dataset_cache_is_one_line(places, tmp_path):
    """RECSYS_CACHE on a read-only mount: the cache's lock file was an OSError traceback."""
    ro, rw, env = places
    code, err = in_read_only([ro], ["train", "hydra.run.dir=rw/run", *TINY],
                             {**env, "RECSYS_CACHE": str(ro / "cache")}, tmp_path)
    assert code == 2, err
    assert one_error_line(err) == (f"error: cannot write the dataset cache {ro / 'cache'} (RECSYS_CACHE, "
                                   "dataset.cache_dir): Read-only file system")
    assert not (rw / "run").exists()  # the failed start removed the run directory it made


@pytest.mark.parametrize("command", [
    ["preprocess", "synthetic", "rows=500", "format=tsv", "progress=false"],
    ["predict", "checkpoint=run", "input=in.tsv"],  # refused before the checkpoint is looked for
])
def test_a_read_only_output_file_is_one_line(places, tmp_path, command):
    ro, rw, env = places
    out = ro / "out.tsv"
    code, err = in_read_only([ro], [*command, f"output={out}"], env, tmp_path)
    assert code == 2, err
    assert one_error_line(err) == f"error: cannot write output {out}: Read-only file system ({ro / '.out.tsv.lock'})"
    assert [p.name for p in ro.iterdir()] == ["cache"]  # nothing was written
