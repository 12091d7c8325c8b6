"""Preemption: SIGTERM stops the run at a step boundary with a checkpoint.

A cluster scheduler sends SIGTERM before it takes the machine (SLURM, Kubernetes,
TorchX; torchrun's agent forwards it to its workers). While a Trainer fits,
the first SIGTERM only sets a flag: the trainer finishes its step, agrees with
the other ranks on the step to stop after (`Trainer.agree_stop_step`), writes
a checkpoint there and raises `Preempted`; the CLI prints one line and exits
with EXIT_STATUS. A second SIGTERM exits at once (the signal's default
action). A copy of the first that arrives within DUPLICATE_S seconds is not a
second one: a scheduler that signals every process of a job, and torchrun
forwarding the same signal, deliver it twice within milliseconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

# 128 + SIGTERM, the shell's status of a process SIGTERM ended: not 0 (the run
# did not finish), not 1 (no bug) nor 2 (no user error); schedulers that requeue
# preempted jobs look at the signal they sent, not at this number.
EXIT_STATUS = 128 + signal.SIGTERM
DUPLICATE_S = 1.0


class Preempted(Exception):
    """The run stopped on SIGTERM after writing a checkpoint; the message says where."""


class SigtermFlag:
    """A context manager: while it is entered (on the main thread), SIGTERM
    sets `requested` instead of ending the process; the previous handler
    comes back on exit. Off the main thread (where Python cannot install a
    handler) it does nothing."""

    def __init__(self) -> None:
        self.requested = False
        self._first: float | None = None
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None  # what signal.signal returns
        self._installed = False

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first, self.requested = now, True
        elif now - self._first >= DUPLICATE_S:  # a second SIGTERM: exit at once
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self) -> "SigtermFlag":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False


def say_preempted(message: str) -> NoReturn:
    """Print `preempted: message` on stderr as one line and exit with EXIT_STATUS."""
    import sys

    from recsys_cli.errors import error_line

    error_line(message, "preempted:", "bold yellow")
    sys.exit(EXIT_STATUS)
