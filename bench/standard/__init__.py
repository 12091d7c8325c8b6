"""The standard set: what `make bench` runs, in this order.

Each module declares one `BENCHMARK` (bench/harness.py's `Benchmark`); add
yours here to put it in the set. A benchmark outside the set runs by its
module path: `python -m bench my.module:BENCHMARK`.
"""

from __future__ import annotations

import importlib
from typing import Any

from bench.harness import Benchmark

STANDARD = {
    "train": "bench.standard.train",
    "placement": "bench.standard.placement",
    "precision": "bench.standard.precision",
    "dedup": "bench.standard.dedup",
    "threads": "bench.standard.threads",
    "memory": "bench.standard.memory",
    "preprocess": "bench.standard.preprocess",
    "predict": "bench.standard.predict",
    "quality": "bench.standard.quality",
    "distributed": "bench.standard.distributed",
}


def load(name: str) -> Benchmark[Any]:
    """The benchmark called `name` in the standard set, or at `module:ATTRIBUTE`."""
    module_name, _, attribute = (STANDARD[name], "", "BENCHMARK") if name in STANDARD else name.partition(":")
    if not attribute:
        raise LookupError(f"no benchmark {name!r} (the standard set: {', '.join(STANDARD)}; "
                          "or module:ATTRIBUTE)")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise LookupError(f"no benchmark {name!r}: {e}") from None
    if not isinstance(found, Benchmark):
        raise LookupError(f"{name} is a {type(found).__name__}, not a Benchmark")
    return found
