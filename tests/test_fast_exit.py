"""recsys_cli/fast_exit.py: a process that is done ends without the
interpreter's finalization, yet runs every exit handler in atexit's order and
loses none of its buffered output. (Only on the way to a successful exit:
recsys_cli/cli.py and the launcher's workers call it after their work has
returned; their failures' statuses: tests/test_bad_input.py,
tests/test_distributed.py.)"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, logging, sys
from recsys_cli.fast_exit import exit_without_finalizing


class Finalized:
    def __del__(self):
        print(" finalized", end="")


kept_until_finalization = Finalized()
logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
atexit.register(lambda: print("first registered, last run", end=""))
if sys.argv[2] == "after":
    exit_without_finalizing()
atexit.register(lambda: print("registered second, run first"))
if sys.argv[2] != "after":
    exit_without_finalizing()
logging.getLogger("x").info("a line for the log file")
sys.stdout.write("buffered, no newline: ")
"""


def run(tmp_path, order: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "log"), order], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert "a line for the log file" in (tmp_path / "log").read_text()
    return done.stdout


def test_exit_handlers_run_once_in_order_output_is_kept_and_finalization_is_skipped(tmp_path):
    assert run(tmp_path, "last") == "buffered, no newline: registered second, run first\nfirst registered, last run"


def test_a_handler_registered_after_it_leaves_the_usual_exit(tmp_path):
    assert run(tmp_path, "after") == ("buffered, no newline: registered second, run first\nfirst registered, last run"
                                      " finalized")
