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
    export, verify, report), and train's config errors found before Hydra
    starts; anything that runs Hydra's app needs its own process."""
    from recsys_cli.cli import main

    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err
