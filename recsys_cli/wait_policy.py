"""How long a waiting OpenMP compute thread spins before it sleeps.

torch's OpenMP runtime (libgomp) lets a compute thread that has finished its
share of a parallel op spin about 300,000 times before it sleeps. On a machine
of its own that makes the next op start at once; beside any other busy
process (a second job, another user's build) the spinning thread holds the
core that the thread it waits for needs, and two compute threads on two cores
run 3-5x slower than one (BENCHMARKS.md, "Compute threads x OpenMP wait
policy"). 1,000 spins (a few microseconds) keep two threads at 0.87-0.94x of
the best setting beside a busy process at batch 1024-2048, and 0.85-0.95x of
it idle; the thread rule (train/threads.py) gives a run a second thread only
for steps that wide.

libgomp reads the setting once, when torch loads it, so `recsys` sets it
before anything imports torch, and leaves it alone when the user set
OMP_WAIT_POLICY or GOMP_SPINCOUNT (their choice wins) or when torch is
already loaded (too late to take effect, so it would only mislead). Torch-free
on purpose: it runs first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

SPIN_COUNT = 1000
USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def set_default(environ: MutableMapping[str, str] = os.environ, modules: Mapping[str, object] = sys.modules) -> bool:
    """GOMP_SPINCOUNT=1000 in `environ` unless the user chose a wait policy or torch
    is loaded already; whether it was set."""
    if "torch" in modules or any(key in environ for key in USER_SETTINGS):
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True


def in_force(environ: Mapping[str, str] = os.environ) -> str:
    """The wait policy this process's environment gives the runtime, for summary.json."""
    chosen = [f"{key}={environ[key]}" for key in USER_SETTINGS if key in environ]
    return " ".join(chosen) or "runtime default"
