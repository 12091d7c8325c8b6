"""Ending a process whose work is done without the interpreter's finalization.

Python's finalization, after the exit handlers, only frees memory: garbage
collections over every module loaded (torch and its compiler stack: about
0.5-1 s of CPU for `recsys train`, ~2 s for a launcher's worker on a 2-core
machine). `exit_without_finalizing()` registers an exit handler that runs
every other exit handler in atexit's order (logging's flush, weakref
finalizers, temporary folders), flushes stdout and stderr and ends the
process with status 0. Call it only once the process's work is done and its
files are closed, on the way to a successful exit: the status is always 0.
A flush that fails (a closed pipe), or an exit handler registered after this
one (it has run before this one: atexit's order), leaves the exit to Python
as before."""

from __future__ import annotations

import atexit
import os
import sys


def exit_without_finalizing() -> None:
    def leave() -> None:
        if atexit._ncallbacks() != registered:  # a handler registered after this one has run already: the usual exit
            return
        atexit.unregister(leave)
        atexit._run_exitfuncs()
        try:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: Python's own exit says so, with its status
            return
        os._exit(0)

    atexit.register(leave)
    registered = atexit._ncallbacks()
