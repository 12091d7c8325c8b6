"""The `recsys` command as the tests run it: the entry point of the
environment running the tests, or main() in this process where a test checks
only what the command prints and its exit status (no process start-up)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

RECSYS = str(Path(sys.executable).with_name("recsys"))


def in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit status, stderr) of `recsys ARGV` run by main() here: for commands
    that compose their config without Hydra's global state (predict, evaluate,
    export, verify, report, preprocess's --help), and train's config errors
    and --help, found before Hydra starts; anything that runs Hydra's app
    needs its own process."""
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
