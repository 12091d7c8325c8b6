"""RECSYS_DETERMINISTIC=1: deterministic algorithms in every process of a command.

The exactness claims are bit for bit (torch.equal against a reference computed
another way). A kernel that accumulates with atomics (a CUDA scatter_add_ of
the kind the lookup's segment reduce replaced) makes a result depend on the
order its threads ran in: such an op would make a run drift, not fail. With
the variable set, torch.use_deterministic_algorithms(True) is on, so the op
either runs a deterministic version or raises. The tests set it for every
exactness test (tests/conftest.py, the `exact` marker), and with it for the
processes those tests start: the command line (cli.main) and the launcher's
workers (distributed.init). Imports torch only when the variable is set, so a
command that needs no torch (`recsys report`) still starts without it.
"""

from __future__ import annotations

import os

from recsys_cli.errors import UserError

__all__ = ["CUBLAS_WORKSPACE", "ENV", "enable", "enable_if_requested", "requested", "settle_vector_math"]

ENV = "RECSYS_DETERMINISTIC"
# cuBLAS is deterministic only with a fixed workspace, read when its first handle is made.
CUBLAS_WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def requested() -> bool:
    """Whether the environment asks for deterministic algorithms (1), or not (unset, empty, 0)."""
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise UserError(f"environment variable {ENV}={value!r}: give 1 (deterministic algorithms) or 0")
    return value == "1"


def enable() -> None:
    """Deterministic algorithms from here on in this process: a kernel without a
    deterministic version raises. Before CUDA's first matmul, for cuBLAS."""
    import torch

    os.environ.setdefault(*CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)


def enable_if_requested() -> bool:
    if requested():
        enable()
        return True
    return False


def settle_vector_math() -> None:
    """Make MKL's first vector-math call on this thread, before any parallel op makes it.

    On CPU, torch's sqrt (and log, exp, tanh ...) of float tensors run MKL's vector
    math (VML), which detects the CPU on its first call and keeps the answer in a
    static that it writes twice: the raw CPU type, then the code path that type
    maps to. A compute thread whose first call falls between the two writes runs
    another CPU's path for its share of that op: a sqrt with errors up to 2^-14
    instead of the accurate path's (within an ulp). Seen on the first parallel sqrt
    of 3 in 100 fresh processes under GOMP_SPINCOUNT=1000 (recsys's wait policy), it
    made the first optimizer step of such a process differ from every other run's
    (tests/test_determinism.py). One call here, on one element, makes the choice
    before the compute threads ask. Idempotent and cheap (microseconds)."""
    import torch

    torch.sqrt(torch.ones(1))
