"""The suite's markers: `slow` (multi-process training) is for deselecting
while developing (`pytest -m 'not slow'`); `make test` and CI run those tests."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", *args, "tests/test_distributed.py"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def test_make_test_runs_the_slow_tests_and_not_slow_leaves_them_out():
    everything = collected()  # what `make test` (pytest with the project's addopts) collects
    fast = collected("-m", "not slow")
    assert any("two_processes" in t for t in everything) and not any("two_processes" in t for t in fast)
    assert fast and set(fast) < set(everything)
