"""Several nodes: two torchrun agents as two "nodes" of one process each.

Each agent is what a user starts on each machine (the commands below,
NODE_COMMAND, are the README's): `--nnodes 2 --nproc-per-node 1`, c10d's
rendezvous at an endpoint both reach (here 127.0.0.1, the first node
hosting its store: is_host=true, the other is_host=false), every address
on the loopback interface (--local-addr, GLOO_SOCKET_IFNAME), and the run
directory and checkpoints on a file system both see (here the same
directory). The runs equal the one-process run on the same global batch as
the multi-process tests hold it (tests/test_distributed.py, test_sharding.py:
per-step losses and every weight to 1e-5: the all-reduce sums gradients in
another order). A node killed mid-run and both resumed is not tested yet
(issue 41 item 5): in a first try the surviving node's agent exited 0 and
waited out torch's 300 s exit barrier.

`make test` runs the replicated pair (test_two_nodes_train_as_one_process,
about 17 s); the sharded pair is `make verify`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from recsys_cli.embeddings.quant import patched_entry
from test_resume_exact import final_checkpoint, records

pytestmark = pytest.mark.exact

SMALL = ["dataset.synthetic.rows=20000", "dataset.synthetic.cardinality_scale=0.0005"]
STEPS = 20
COMMON = [*SMALL, "trainer.progress=false", "trainer.log_every=1", "trainer.checkpoint_every=10",
          f"trainer.max_steps={STEPS}", "trainer.dist_timeout=30"]
WAIT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(node: int, port: int, run_id: str, args: list[str]) -> list[str]:
    """What a user runs on node `node` (0 or 1) of two, one training process each."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "--local-addr", "127.0.0.1",
            "--max-restarts", "0", "-m", "recsys_cli", "train", *args]


def env(work: Path) -> dict[str, str]:
    return {**os.environ, "RECSYS_CACHE": str(work.parent / "cache"), "GLOO_SOCKET_IFNAME": "lo"}


def start_nodes(work: Path, args: list[str], run: str) -> list[subprocess.Popen]:
    port, run_id = free_port(), f"recsys-{uuid.uuid4().hex[:8]}"
    return [subprocess.Popen(node_command(node, port, run_id, [*args, f"hydra.run.dir={run}"]), cwd=work,
                             env=env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
            for node in (0, 1)]


def finish(nodes: list[subprocess.Popen]) -> list[tuple[int, str]]:
    out = []
    try:
        for proc in nodes:
            text, _ = proc.communicate(timeout=WAIT_S)
            out.append((proc.returncode, text))
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return out


def two_nodes(work: Path, args: list[str], run: str) -> None:
    for code, text in finish(start_nodes(work, [*COMMON, *args], run)):
        assert code == 0, text[-3000:]


def one_process(work: Path, args: list[str], run: str) -> None:
    from commands import RECSYS

    done = subprocess.run([RECSYS, "train", *COMMON, *args, f"hydra.run.dir={run}"], cwd=work, env=env(work),
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def weights(run: Path) -> dict[str, torch.Tensor]:
    """Dense weights and every table's fp32 rows of the run's last checkpoint."""
    state = final_checkpoint(run, STEPS)
    out = {f"model.{k}": v for k, v in state["model"].items()}
    out.update({f"table.{name}": patched_entry(entry)["weights"] for name, entry in state["tables"].items()})
    return out


def assert_follows_one_process(run: Path, reference: Path, rel: float = 1e-5) -> None:
    """tests/test_distributed.py's assert_same, from the runs' files."""
    losses = [r["loss"] for r in records(run) if "loss" in r and "split" not in r]
    expected = [r["loss"] for r in records(reference) if "loss" in r and "split" not in r]
    assert len(losses) == len(expected) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=rel, atol=0)
    got, ref = weights(run), weights(reference)
    assert got.keys() == ref.keys()
    for name, w in ref.items():
        torch.testing.assert_close(got[name], w, rtol=rel, atol=rel * float(w.abs().max()), msg=name)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("multinode") / "work"
    work.mkdir()
    one_process(work, [], "one")
    return work


@pytest.mark.slow  # two agents, two processes: about 20 s
def test_two_nodes_train_as_one_process(work):
    two_nodes(work, [], "replicated")
    summary = json.loads((work / "replicated" / "summary.json").read_text())
    assert summary["distributed"]["world_size"] == 2 and summary["steps"] == STEPS
    assert_follows_one_process(work / "replicated", work / "one")
    assert not (work / "outputs").exists()  # the other node composed its config in a scratch directory


@pytest.mark.verify
def test_two_nodes_sharded_train_as_one_process(work):
    two_nodes(work, ["placement.sharding=row"], "sharded")
    assert_follows_one_process(work / "sharded", work / "one")
