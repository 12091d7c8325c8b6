"""Tests marked `verify` are the long matrix: `make verify` runs them (RECSYS_VERIFY=1), `make test` skips them.

Tests marked `exact` (the exactness tests and their CUDA twins) run under
torch.use_deterministic_algorithms(True), as do the processes they start
(RECSYS_DETERMINISTIC=1, recsys_cli/determinism.py): an op without a
deterministic version fails such a test instead of making it drift."""

import os

from recsys_cli import wait_policy

# The OpenMP wait policy `recsys` sets for itself (recsys_cli/wait_policy.py), before torch loads
# libgomp: with libgomp's default spin each pytest worker's waiting compute threads held the cores
# the other worker needed (six in-process test files on two workers, 2 idle cores: 84-89 s with the
# default, 42-50 s with this).
wait_policy.set_default()

import pytest  # noqa: E402
import torch  # noqa: E402

from recsys_cli import determinism  # noqa: E402

# MKL's CPU detection, made here once before any test's parallel op (determinism.settle_vector_math).
determinism.settle_vector_math()
# cuBLAS reads its workspace setting when its first handle is made, before any test's first matmul on CUDA.
os.environ.setdefault(*determinism.CUBLAS_WORKSPACE)
_ENV_AT_START = os.environ.get(determinism.ENV)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RECSYS_VERIFY"):
        return
    skip = pytest.mark.skip(reason="part of `make verify` (RECSYS_VERIFY=1)")
    for item in items:
        # The marker itself, not item.keywords: keywords also hold the names of
        # parent nodes, so a checkout in a folder named "verify" skipped everything.
        if item.get_closest_marker("verify") is not None:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the item's fixtures: a module-scoped fixture that trains (or
    starts processes) for an exact test runs under the same setting."""
    exact = item.get_closest_marker("exact") is not None
    if exact:
        os.environ[determinism.ENV] = "1"
    elif _ENV_AT_START is None:
        os.environ.pop(determinism.ENV, None)
    else:
        os.environ[determinism.ENV] = _ENV_AT_START
    torch.use_deterministic_algorithms(exact or determinism.requested())


# torchrun's variables: a process that has all of them takes itself for a
# rank (distributed.launched_by_agent). One test left them in its pytest
# worker's environment, and the next `recsys train` started from that worker
# bound their stale port and failed (clean-clone CI, 2026-12-05).
AGENT_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _agent_variables_do_not_outlive_a_test(request):
    before = {k: os.environ.get(k) for k in AGENT_VARIABLES}
    yield
    after = {k: os.environ.get(k) for k in AGENT_VARIABLES}
    assert after == before, f"{request.node.nodeid} left torchrun's variables changed: {before} -> {after}"


@pytest.fixture
def one_compute_thread():
    """Score with one compute thread, as `recsys predict` and the trainer do on
    two cores: a GEMM's sums, and so the last bits, depend on the thread count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
