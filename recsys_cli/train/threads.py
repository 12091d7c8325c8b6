"""How many torch compute (intra-op) threads a training process uses.

torch starts one intra-op thread per core. The trainer also keeps background
threads busy on the same cores: the loader (reads parquet, dedups, plans
the lookups), the lookahead prefetcher (fills the cache) and, with several
processes, the plan-ahead thread. With as many compute threads as cores,
every parallel op waits for a thread that a background thread has pushed
off its core; on a loaded 2-core machine two compute threads beside the
loader cut throughput by an order of magnitude (issue 18; BENCHMARKS.md,
"compute threads", has the measurement behind the rule).

The rule: the cores this process may use (its CPU affinity and cgroup
quota), shared among the processes of this machine, minus one per busy
background thread, and at least one. `trainer.threads=N` sets N instead;
with OMP_NUM_THREADS in the environment (torchrun sets it) and no
trainer.threads, torch's setting is kept. The count applies while fit()
runs and is restored afterwards.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch


def available_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup
    v2 CPU quota (containers) when one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def default_threads(cores: int, background: int, local_processes: int = 1) -> int:
    """Compute threads that leave a core to each busy background thread."""
    return max(1, cores // max(1, local_processes) - background)


@contextmanager
def compute_threads(requested: Optional[int], background: int, local_processes: int = 1) -> Iterator[int]:
    """torch's intra-op threads for the duration of the block: `requested`,
    else the default rule (module docstring); yields the count in use."""
    previous = torch.get_num_threads()
    if requested is not None:
        threads = requested
    elif "OMP_NUM_THREADS" in os.environ:
        threads = previous
    else:
        threads = default_threads(available_cores(), background, local_processes)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(previous)
