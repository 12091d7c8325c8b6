"""The package as a user gets it: `recsys --version` names the version in
pyproject.toml."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest

import recsys_cli
from recsys_cli.cli import main

REPO = Path(__file__).resolve().parents[1]


def pyproject_version() -> str:
    match = re.search(r'(?m)^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text())
    assert match, "pyproject.toml has no version line"
    return match.group(1)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_pyprojects(flag, capsys):
    main([flag])
    out = capsys.readouterr().out
    assert version("recsys") == pyproject_version()  # the installed metadata is the checkout's (make setup)
    assert out.startswith(f"recsys {pyproject_version()} from {Path(recsys_cli.__file__).resolve().parent} ")
    assert out.count("\n") == 1
