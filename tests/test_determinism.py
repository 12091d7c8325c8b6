"""The `exact` marker (tests/conftest.py): an exactness test, and every process it
starts, runs under torch.use_deterministic_algorithms(True), so an op without a
deterministic version fails it instead of making it drift; other tests do not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys_cli import determinism

REPO = Path(__file__).resolve().parents[1]
# What a process reports at exit: whether deterministic algorithms were on.
REPORT_AT_EXIT = ("import atexit, torch\n"
                  "atexit.register(lambda: print('deterministic', torch.are_deterministic_algorithms_enabled()))\n")


def _child(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", REPORT_AT_EXIT + code], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=300)  # a hang guard: the child takes about a second


NONDETERMINISTIC = "torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))"  # no deterministic version


def _nondeterministic_op() -> None:
    torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))


@pytest.mark.exact
def test_an_exact_test_and_the_processes_it_starts_run_deterministic_algorithms():
    assert torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="deterministic"):
        _nondeterministic_op()
    assert os.environ[determinism.ENV] == "1"
    # the command line: every command turns them on before it runs
    cli = _child("from recsys_cli.cli import main\nmain(['report', '/nonexistent-run-dir'])")
    assert cli.returncode == 2 and "deterministic True" in cli.stdout, cli.stdout + cli.stderr
    # a launcher's worker (spawned: no cli.main) turns them on when it joins the process group
    worker = _child("import os\n"
                    "os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[1])\n"
                    "from recsys_cli.train import distributed\n"
                    "distributed.init(timeout_s=60, device='cpu')\n"
                    f"try:\n    {NONDETERMINISTIC}\nexcept RuntimeError as e:\n    print('raised', e)\n"
                    "distributed.teardown()\n".replace("sys.argv[1]", repr(str(_free_port()))))
    assert worker.returncode == 0, worker.stderr[-2000:]
    assert "raised put_ does not have a deterministic implementation" in worker.stdout and \
        "deterministic True" in worker.stdout, worker.stdout


def _free_port() -> int:
    from recsys_cli.train.distributed import free_port

    return free_port()


def test_other_tests_and_their_processes_do_not():
    if determinism.requested():
        pytest.skip(f"{determinism.ENV}=1 for the whole session")
    assert not torch.are_deterministic_algorithms_enabled()
    assert os.environ.get(determinism.ENV) in (None, "", "0")
    _nondeterministic_op()
    assert "deterministic False" in _child("import recsys_cli.cli").stdout


def test_a_bad_value_is_one_line_exit_2():
    env = {**os.environ, determinism.ENV: "yes"}
    got = _child("from recsys_cli.cli import main\nmain(['report', '/nonexistent-run-dir'])", env)
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
    assert f"{determinism.ENV}='yes'" in got.stdout + got.stderr and "give 1" in got.stdout + got.stderr


# --- MKL's first vector-math call (determinism.settle_vector_math) --------------------------------------------------

# A fresh process's first parallel sqrt, on two compute threads, against the same sqrt on one thread once MKL has
# chosen its code path. Without the settling call 3 of 100 such processes differed (GOMP_SPINCOUNT=1000, 2-core
# Intel Xeon, 2026-12-06); the second thread's half had errors up to 565 ulps.
FIRST_PARALLEL_SQRT = """
import torch
from recsys_cli import determinism
determinism.settle_vector_math()
torch.set_num_threads(2)
x = torch.linspace(0.05, 0.84, 786_496)
x.mul(2)  # the compute threads start
root = torch.sqrt(x)  # the process's first parallel sqrt
torch.set_num_threads(1)
print("same" if torch.equal(root, torch.sqrt(x)) else "differ")
"""


@pytest.mark.verify
def test_the_first_parallel_sqrt_of_a_process_runs_one_code_path_on_every_thread():
    env = {**os.environ, "GOMP_SPINCOUNT": "1000"}  # recsys's wait policy, under which the race was seen
    env.pop("OMP_WAIT_POLICY", None)
    results = [subprocess.run([sys.executable, "-c", FIRST_PARALLEL_SQRT], cwd=REPO, capture_output=True, text=True,
                              env=env, timeout=300).stdout.strip() for _ in range(100)]
    assert results == ["same"] * 100


def test_training_and_scoring_settle_mkl_before_their_first_op(tmp_path, monkeypatch):
    from recsys_cli.inference import load_model
    from train_config import config, train

    calls: list[str] = []
    monkeypatch.setattr(determinism, "settle_vector_math", lambda: calls.append("settled"))
    trainer = train(config(tmp_path, trainer__max_steps=2, trainer__checkpoint_dir=str(tmp_path / "ck")),
                    run_dir=tmp_path / "run")
    assert calls == ["settled"] and trainer.step == 2
    load_model(tmp_path / "ck", device="cpu")
    assert calls == ["settled", "settled"]
