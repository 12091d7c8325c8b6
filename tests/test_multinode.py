"""Several nodes: two torchrun agents as two "nodes" of one process each.

Each agent is what a user starts on each machine (node_command's flags are
those of docs/how-to/multi-process.md's commands, a test below holds them
so): `--nnodes 2 --nproc-per-node 1`, c10d's rendezvous at an endpoint both
reach (here 127.0.0.1, the first node hosting its store: is_host=true, the
other is_host=false), every address on the loopback interface
(--local-addr, GLOO_SOCKET_IFNAME), and the run directory and checkpoints on
a file system both see (here the same directory). The runs equal the
one-process run on the same global batch as the multi-process tests hold it
(tests/test_distributed.py, test_sharding.py: per-step losses and every
weight to 1e-5: the all-reduce sums gradients in another order).

A lost node: once the first checkpoint is written, one node is killed
(SIGKILL to its agent and its training process), the other's agent ends
with an error, and the same two commands with `trainer.resume=last` end
where the uninterrupted two-node run ends, bit for bit (every checkpoint
tensor, every metrics.jsonl line, the final metrics). The replicated run
loses the node that does not host the rendezvous store, the sharded run the
one that does: torch's agent fails differently for each (its workers' gloo
connection reset; its own store connection lost).

`make test` runs the replicated pair and its kill + resume; the sharded
ones are `make verify`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from recsys_cli.embeddings.quant import patched_entry
from test_distributed import workers_of
from test_resume_exact import assert_identical, final_checkpoint, records

pytestmark = pytest.mark.exact

SMALL = ["dataset.synthetic.rows=20000", "dataset.synthetic.cardinality_scale=0.0005"]
STEPS = 60  # a node is lost after the step-10 checkpoint; 20 steps ended before the kill landed (clean-clone CI)
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
                kill_node(proc)
    return out


def two_nodes(work: Path, args: list[str], run: str) -> str:
    """Run both nodes to the end; what the first (rank 0, which prints) printed."""
    done = finish(start_nodes(work, [*COMMON, *args], run))
    for code, text in done:
        assert code == 0, text[-3000:]
    return done[0][1]


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


def kill_node(agent: subprocess.Popen) -> list[int]:
    """SIGKILL one node: its agent and its training processes (their pids).
    torchrun starts each worker in a session of its own, so the agent's
    process group is not the whole node: a worker left alive trains on with
    its peer, and the other agent, done, waits out torch's 300 s exit barrier
    for the dead one."""
    workers = workers_of(agent.pid, b"recsys_cli")
    for group in (agent.pid, *workers):  # the agent first: it must not see its worker die and react
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    agent.wait(timeout=WAIT_S)
    return workers


def lose_a_node_then_resume(work: Path, args: list[str], run: str, lost: int) -> None:
    """Run the two nodes until the first checkpoint, kill node `lost`, let
    the other fail, then relaunch both with trainer.resume=last in the same
    run directory."""
    latest = work / run / "checkpoints" / "latest.json"
    nodes = start_nodes(work, [*COMMON, *args], run)
    try:
        deadline = time.monotonic() + WAIT_S
        while not latest.exists() and time.monotonic() < deadline and all(p.poll() is None for p in nodes):
            time.sleep(0.02)
        assert latest.exists(), nodes[0].communicate(timeout=WAIT_S)[0][-3000:]
        assert len(kill_node(nodes[lost])) == 1  # the node's one training process went with its agent
        survivor = nodes[1 - lost]
        text, _ = survivor.communicate(timeout=WAIT_S)  # bounded: a survivor that hangs fails the test
        assert survivor.returncode != 0, text[-3000:]
    finally:
        finish(nodes)
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < STEPS, "the run finished before a node was lost"
    said = " ".join(two_nodes(work, [*args, "trainer.resume=last"], run).split())  # unwrapped
    assert re.search(rf"resumed from \S.* at step {killed_at}\b", said), said[-3000:]  # not trained afresh


def assert_resumed_exactly(run: Path, uninterrupted: Path) -> None:
    """tests/test_resume_exact.py's claim for a run killed and resumed in its own directory."""
    assert_identical(final_checkpoint(uninterrupted, STEPS), final_checkpoint(run, STEPS))
    assert records(run) == records(uninterrupted)  # metrics.jsonl rewound to the checkpoint and continued
    final = lambda r: json.loads((r / "summary.json").read_text())["final"]  # noqa: E731
    assert final(run) == final(uninterrupted)


def documented_commands() -> list[list[str]]:
    """The torchrun commands of docs/how-to/multi-process.md's "Several nodes"
    (its first bash block, continuation lines joined)."""
    text = (Path(__file__).parents[1] / "docs" / "how-to" / "multi-process.md").read_text()
    section = text[text.index("## Several nodes"):]
    block = section[section.index("```bash\n") + 8:section.index("\n```", section.index("```bash\n"))]
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.startswith("torchrun ")]


def test_the_documented_commands_are_the_ones_the_tests_run():
    """The flags a user types on each node, and the relaunch after a lost
    node, are node_command's; the training arguments are the user's own."""
    documented = documented_commands()
    assert len(documented) == 4  # two nodes, then both again
    for index, command in enumerate(documented):
        node, args = index % 2, command[command.index("train") + 1:]
        launch = " ".join(command).replace("HOST0", "127.0.0.1").replace("HOST1", "127.0.0.1").split()
        assert [sys.executable, "-m", "torch.distributed.run", *launch[1:]] == node_command(node, 29500, "JOB", args)
        assert (args[-1] == "trainer.resume=last") if index >= 2 else ("trainer.resume=last" not in args)
    assert documented[2][:-1] == documented[0] and documented[3][:-1] == documented[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("multinode") / "work"
    work.mkdir()
    one_process(work, [], "one")
    return work


@pytest.fixture(scope="module")
def replicated(work) -> Path:
    two_nodes(work, [], "replicated")
    return work / "replicated"


@pytest.fixture(scope="module")
def sharded(work) -> Path:
    two_nodes(work, ["placement.sharding=row"], "sharded")
    return work / "sharded"


@pytest.mark.slow  # two agents, two processes: about 20 s
def test_two_nodes_train_as_one_process(work, replicated):
    summary = json.loads((replicated / "summary.json").read_text())
    assert summary["distributed"]["world_size"] == 2 and summary["steps"] == STEPS
    assert_follows_one_process(replicated, work / "one")
    assert not (work / "outputs").exists()  # the other node composed its config in a scratch directory


@pytest.mark.slow  # two launches of two agents: 30-50 s on a loaded 2-core machine
def test_a_lost_node_resumed_on_both_ends_as_the_uninterrupted_run(work, replicated):
    lose_a_node_then_resume(work, [], "lost-node-1", lost=1)
    assert_resumed_exactly(work / "lost-node-1", replicated)


@pytest.mark.verify
def test_two_nodes_sharded_train_as_one_process(work, sharded):
    assert_follows_one_process(sharded, work / "one")


@pytest.mark.verify
def test_a_lost_store_host_resumed_on_both_ends_sharded_as_the_uninterrupted_run(work, sharded):
    lose_a_node_then_resume(work, ["placement.sharding=row"], "lost-node-0", lost=0)
    assert_resumed_exactly(work / "lost-node-0", sharded)
