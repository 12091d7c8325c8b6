"""How many torch compute (intra-op) threads a training process uses.

torch starts one intra-op thread per core. The trainer also keeps background
threads busy on the same cores: the loader (reads parquet, dedups, plans
the lookups), the lookahead prefetcher (fills the cache) and, with several
processes, the plan-ahead thread. A compute thread that a background thread
(or another process) has pushed off its core makes every parallel op wait
for it, and a step of ~150 small ops waits often.

The rule: the cores this process may use (its CPU affinity and cgroup
quota), shared among the processes of this machine; then

* a step whose matrix products come to WIDE_STEP_MACS multiply-adds or more
  (dlrm_kaggle from batch 1024) takes every one of those cores: the products
  are long enough that a second thread pays for its waits, with the short
  spin count that `recsys` sets (wait_policy.py);
* a narrower step leaves a core to each busy background thread (at least one
  compute thread): there the second core's gain, 1.2x idle at dlrm_kaggle
  batch 128, comes only with long spinning waits, and those collapse beside
  any other busy process (0.23-0.37x).

BENCHMARKS.md, "Compute threads x OpenMP wait policy", has the measurements.
The count is a function of the config and the machine's cores, never of
timing: a second thread changes how MKL splits a sum, so it changes the bits.
`trainer.threads=N` sets N; with OMP_NUM_THREADS in the environment (torchrun
sets it) and no trainer.threads, torch's setting is kept. The count applies
while fit() runs and is restored afterwards.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

# Two measured points bound it (2 cores, loader running, 1,000 spins): at dlrm_kaggle batch
# 512 (2.4e8 multiply-adds) a second thread gains nothing idle and runs at 0.78x of one
# beside a busy process; at batch 1024 (4.9e8) it gains 1.25x idle and holds 0.87x beside one.
WIDE_STEP_MACS = 400_000_000


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


def matmul_macs_per_sample(model: nn.Module) -> int:
    """Multiply-adds of the model's linear layers for one sample's forward pass."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def default_threads(cores: int, background: int, local_processes: int = 1, step_macs: int = 0) -> int:
    """Every core of this process's share for a wide step, else one left to each
    busy background thread (module docstring)."""
    share = max(1, cores // max(1, local_processes))
    return share if step_macs >= WIDE_STEP_MACS else max(1, share - background)


@contextmanager
def compute_threads(requested: Optional[int], background: int, local_processes: int = 1,
                    step_macs: int = 0) -> Iterator[int]:
    """torch's intra-op threads for the duration of the block: `requested`,
    else the default rule (module docstring); yields the count in use."""
    previous = torch.get_num_threads()
    if requested is not None:
        threads = requested
    elif "OMP_NUM_THREADS" in os.environ:
        threads = previous
    else:
        threads = default_threads(available_cores(), background, local_processes, step_macs)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(previous)
