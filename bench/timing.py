"""Seconds spent in a function, measured where it is called: how a benchmark
splits a run into its parts without the code under test knowing."""

from __future__ import annotations

import time
from collections.abc import MutableMapping


def time_calls(owner, name: str, totals: MutableMapping[str, float], key: str) -> None:
    """Replace `owner.name` (a module's, a class's or one object's function)
    by one that adds each call's wall seconds to totals[key]."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - began

    setattr(owner, name, timed)
