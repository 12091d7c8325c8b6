"""The `recsys` command as the tests run it: the entry point of the
environment running the tests, or main() in this process where a test checks
only what the command prints, its exit status and the files it leaves (no
process start-up: 2-4 s of a loaded 2-core machine per child that imports
torch). Each command keeps at least one real-process test of its exit status
and its one-line errors."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

RECSYS = str(Path(sys.executable).with_name("recsys"))


def in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit status, stderr) of `recsys ARGV` run by main() here: for commands
    that compose their config without Hydra's global state (predict, evaluate,
    export, verify, report, preprocess), and train's config errors and
    --help, found before Hydra starts; a train that runs Hydra's app goes
    through train_in_process."""
    code, _, err = in_process_output(argv, capsys)
    return code, err


def in_process_output(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `recsys ARGV`, as in_process."""
    from recsys_cli.cli import main

    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def train_in_process(args: list[str], *, cwd: Path, capsys: pytest.CaptureFixture[str],
                     monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess[str]:
    """`recsys train ARGS` run by main() in this process, Hydra's app included,
    as tests/test_bad_input.py's recsys() runs it in a child (cwd, RECSYS_CACHE
    under cwd, COLUMNS=200): for a test of the lines a run prints, its exit
    status and the files it leaves, not of the process (start-up, signals,
    exit codes of the interpreter: those keep a real-process test).

    Hydra's app runs once per process: it leaves its GlobalHydra initialised,
    its HydraConfig set and the logging configured (a file handler on the
    run's app.log), and recsys_cli.train.app keeps what it saw of the command
    line in module globals. All of that is put back as it was after the run,
    and the app's globals start as a fresh process has them."""
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("RECSYS_CACHE", str(Path(cwd) / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    with _fresh_hydra_app():
        return completed_in_process(["train", *map(str, args)], capsys)


def completed_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """`recsys ARGV` by main() here (as in_process), as subprocess.run would
    report the child: for helpers that take a finished process."""
    code, out, err = in_process_output(argv, capsys)
    return subprocess.CompletedProcess(["recsys", *argv], code, out, err)


@contextlib.contextmanager
def _fresh_hydra_app() -> Iterator[None]:
    import torch
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from recsys_cli.train import app

    def all_loggers() -> list[logging.Logger]:
        named = [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
        return [logging.getLogger(), *named]

    saved = {lg: (lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in all_loggers()}
    argv, threads, hydra_config = sys.argv[:], torch.get_num_threads(), HydraConfig.instance().cfg
    GlobalHydra.instance().clear()
    app._started, app._output_subdir = False, ".hydra"  # as at import
    app._existing.clear()
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = hydra_config  # the run's, read by distributed_app: not for later tests
        for lg in all_loggers():
            handlers, level, propagate, disabled = saved.get(lg, ([], logging.NOTSET, True, False))
            for handler in lg.handlers:
                if handler not in handlers:
                    handler.close()  # Hydra's: the run's app.log, a stream on the captured stdout
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
        sys.argv[:] = argv
        torch.set_num_threads(threads)
