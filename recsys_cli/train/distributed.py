"""Multi-process training: process groups, the launcher, and small collectives.

One process per device, each training its slice of every global batch on a
full replica of the tables (data parallel; how the replicas stay in step is
strategies/). Two ways to start them:

* ``torchrun --nproc-per-node N -m recsys_cli train ...`` (and, across nodes,
  torchrun's ``--nnodes/--node-rank/--rdzv-endpoint``). torchrun's elastic
  agent starts the processes; each runs the Hydra app itself and joins the
  group from the environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR...).
  Ranks other than 0 compose the config in a scratch Hydra directory and take
  rank 0's run directory, which rank 0 broadcasts once the group is up, so only
  rank 0's directory exists and matters.
* ``recsys train trainer.nproc=N``: the Hydra app composes the config and the
  run directory once, then `launch` starts N workers through torch.distributed's
  own launcher (``elastic_launch`` + ``LaunchConfig``: c10d's rendezvous on
  127.0.0.1 at a free port, max_restarts=0; everything it and the workers
  listen on bound to 127.0.0.1, see launch_config). Each worker
  (distributed_app.worker_main) gets the resolved config as a plain container
  and the run directory.

Failure: the elastic agent watches its workers; when one raises or is killed
it stops the others (SIGTERM, then SIGKILL) and `launch` raises `WorkerFailed`
naming the rank, its pid and the cause. The main, control and prefetch groups are
created with ``trainer.dist_timeout`` seconds, so a collective whose peer
hangs without dying raises within that time instead of waiting forever; the
checkpoint group waits CHECKPOINT_WAIT_S (24 hours), as a save of large
tables may take longer than any step.

Process groups. ``main``: NCCL on CUDA, gloo on CPU; dense gradients, cache
syncs and evaluation, issued only by the main thread. ``checkpoint``: gloo;
only checkpoint_barrier and the sharded save, on the main thread, where the
other ranks wait for rank 0's save. ``control``: gloo, trainer.dist_timeout;
the main thread's per-step agreement (agree_max: a SIGTERM, the stop step).
``prefetch``: always gloo
(host tensors); the per-batch all-gather of unique row ids and, in cache_avg
mode, rank 0's cache fills, issued only by the one thread that prepares batches
ahead (the prefetcher thread, or UnionAhead's thread without lookahead). Keeping
them apart keeps each group's collectives in the same order on every rank
although two threads issue them. How the embeddings stay in step across ranks
is in strategies/ (grad_sync.py, cache_avg.py).

Only rank 0 writes metrics.jsonl, summary.json and checkpoints, and prints the
progress bar and the summary. Every rank restores a checkpoint; the loader
position in it counts global batches, so a run may resume with another number
of processes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from recsys_cli import determinism
from recsys_cli.errors import UserError

# Set by torchrun and by the elastic launcher in every worker.
AGENT_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How long ranks wait for rank 0 to write a checkpoint: a save of large host
# tables may take far longer than a step's dist_timeout. A rank 0 that dies
# meanwhile is noticed by the launcher (it stops the others), not by this timeout.
CHECKPOINT_WAIT_S = 24 * 3600.0
# How long `recsys train trainer.nproc=N`, sent SIGTERM, waits for its workers
# to stop with a checkpoint before it kills them.
PREEMPTION_WAIT_S = 120
# LaunchConfig fields newer torch releases added, set where the installed
# torch has them. shutdown_timeout (torch >= 2.12): on SIGTERM the agent passes
# it to the workers and waits this long for them to finish the step and write
# their checkpoint (train/preemption.py); older agents wait their own default.
OPTIONAL_LAUNCH_FIELDS: dict[str, Any] = {"shutdown_timeout": PREEMPTION_WAIT_S}
# Once a worker of `launch` has finished training, how long the others have to
# exit before the launcher kills them (a rank stopped or stuck in teardown kept
# it waiting without bound, issue 40 problem 7).
TEARDOWN_WAIT_S = 60.0
MARKS_ENV = "RECSYS_LAUNCH_MARKS"  # the directory where `launch`'s workers say they started and trained
# The scratch directories this module makes in the temp dir: `launch`'s marks
# (recsys-launch-<pid>-XXXX) and a torchrun follower's Hydra directory
# (recsys-rank<R>-<pid>-XXXX). Each is removed when its process ends; a process
# killed with SIGKILL cannot, so `scratch_dir` removes those of dead pids first.
SCRATCH_NAMES = r"recsys-(?:launch|rank[0-9]+)-([0-9]+)-.*"


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str | None = None
    group: Any = None  # the main group (None: torch's default group)
    prefetch_group: Any = None  # gloo, for the thread ahead of the trainer (prefetcher or UnionAhead)
    timeout_s: float = 0.0
    checkpoint_group: Any = None  # gloo, CHECKPOINT_WAIT_S timeout: waiting for rank 0's save
    control_group: Any = None  # gloo, timeout_s: the main thread's per-step agreement (agree_max)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_context = DistContext()


def current() -> DistContext:
    """This process's place in the group; world_size 1 when not distributed.
    A group that a script set up itself (dist.init_process_group) is adopted
    (the first call is then collective: every rank must make it)."""
    global _context
    if not _context.enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        _context = DistContext(
            dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", world)), dist.get_backend(), None, dist.new_group(backend="gloo"),
            checkpoint_group=dist.new_group(backend="gloo", timeout=timedelta(seconds=CHECKPOINT_WAIT_S)),
            control_group=dist.new_group(backend="gloo"),
        )
    return _context


def launched_by_agent() -> bool:
    """True in a worker started by torchrun or the elastic launcher."""
    return all(k in os.environ for k in AGENT_ENV)


def init(timeout_s: float = 120.0, device: str = "auto") -> DistContext:
    """Join the process group described by the environment (torchrun's or the
    launcher's): NCCL when training on CUDA, gloo on CPU, plus the gloo prefetch
    group, both timing out after `timeout_s` seconds, and the gloo checkpoint
    group (CHECKPOINT_WAIT_S, or `timeout_s` if longer)."""
    global _context
    if dist.is_initialized():
        return _context
    determinism.enable_if_requested()  # a spawned worker runs no cli.main
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    from recsys_cli.device import parse_device

    cuda = parse_device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it; the launcher API does not
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timeout)
    prefetch_group = dist.new_group(backend="gloo", timeout=timeout)
    checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout_s, CHECKPOINT_WAIT_S)))
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    _context = DistContext(rank, world, local_rank, local_world, backend, None, prefetch_group, timeout_s, checkpoint_group,
                           control_group)
    return _context


def checkpoint_barrier() -> None:
    """Every rank waits here until rank 0 has written the checkpoint (the
    checkpoint group's long timeout, not the step's)."""
    if _context.enabled:
        dist.barrier(group=_context.checkpoint_group)


def agree_max(value: int) -> int:
    """The largest of every rank's `value`, on every rank (the control group:
    gloo on the host, so a per-step call costs no device sync; with the
    step's timeout, not the checkpoint group's 24 hours: a peer stopped just
    before it ended the run only a day later, issue 40 problem 7)."""
    if not _context.enabled:
        return value
    box = torch.tensor([value], dtype=torch.int64)
    group = _context.control_group if _context.control_group is not None else _context.checkpoint_group
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    return int(box[0])


def teardown() -> None:
    global _context
    if dist.is_initialized():
        dist.destroy_process_group()
    _context = DistContext()


# --- collectives -----------------------------------------------------------------


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_mean(tensors: list[torch.Tensor], group=None) -> None:
    """Average `tensors` (float) across ranks in place, flattened into one
    buffer: one collective however many tensors."""
    world = dist.get_world_size(group)
    if world == 1 or not tensors:
        return
    device = _comm_device(group)
    flat = torch.cat([t.detach().reshape(-1).to(device, torch.float32) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view(t.shape))
        offset += n


def all_gather_split(parts: list[torch.Tensor], group=None) -> list[list[torch.Tensor]]:
    """Every rank's `parts` (same count and dtype on every rank, lengths along
    dim 0 free), as [rank][part]: the lengths are all-gathered, the
    concatenation is padded to the longest and all-gathered, then cut."""
    world = dist.get_world_size(group)
    if world == 1:
        return [list(parts)]
    device = _comm_device(group)
    source = parts[0]
    lengths = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64, device=device)
    all_lengths = [torch.empty_like(lengths) for _ in range(world)]
    dist.all_gather(all_lengths, lengths, group=group)
    lengths_of = [lens.tolist() for lens in all_lengths]  # rank -> its parts' lengths
    longest = max(sum(lens) for lens in lengths_of)
    flat = torch.cat([p.to(device) for p in parts]) if parts else source.new_zeros(0)
    if longest == 0:
        return [[flat[:0].to(source.device) for _ in parts] for _ in range(world)]
    padded = flat.new_zeros((longest, *flat.shape[1:]))
    padded[: flat.shape[0]] = flat
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    out = []
    for buf, lens in zip(gathered, lengths_of):
        out.append([c.to(source.device) for c in torch.split(buf[: sum(lens)], lens)])
    return out


def all_gather_varlen(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's `tensor` (lengths along dim 0 may differ), in rank order."""
    return [parts[0] for parts in all_gather_split([tensor], group)]


def broadcast_(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Broadcast from `src`; returns the received tensor (on `tensor`'s device)."""
    device = _comm_device(group)
    buf = tensor.to(device)
    dist.broadcast(buf, src, group=group)
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=group)
    return box[0]


# --- a peer that stopped answering ---------------------------------------------------------


class PeerTimeout(Exception):
    """A collective of this rank timed out (trainer.dist_timeout): a peer
    hung, was stopped (SIGSTOP) or is stuck. The message names the ranks that
    did not answer and the timeout, in one line: the underlying error's text
    (gloo's `[.../unbound_buffer.cc:78] Timed out ...`) is not repeated."""


ROLL_CALL_S = 5.0  # after a timeout: how long a rank waits for the others to report theirs


def timed_out(e: BaseException | None) -> bool:
    """Whether `e` (or an exception behind it) is a collective's timeout
    (gloo: "Timed out waiting ...ms for recv"; NCCL's watchdog: "...
    collective operation timeout")."""
    seen = 0
    while e is not None and seen < 8:
        text = str(e).lower()
        if isinstance(e, RuntimeError) and ("timed out" in text
                                            or (isinstance(e, dist.DistBackendError) and "timeout" in text)):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def peer_timeout(timeout_s: float) -> PeerTimeout:
    """This rank's collective timed out: which peers did not answer. With two
    ranks, the other one; with more, a roll call on the rendezvous store: the
    ranks that do not also report a timeout within ROLL_CALL_S."""
    ctx = _context
    others = [r for r in range(ctx.world_size) if r != ctx.rank]
    silent = others
    if len(others) > 1:
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
            store.set(f"recsys/timed_out/{ctx.rank}", "1")
            deadline = time.monotonic() + ROLL_CALL_S
            while True:
                silent = [r for r in others if not store.check([f"recsys/timed_out/{r}"])]
                if not silent or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
        except Exception:  # the store itself is gone: say what is known
            silent = others
    names = ", ".join(f"rank {r}" for r in silent) if silent else "every other rank (each timed out too)"
    return PeerTimeout(f"rank {ctx.rank} waited {timeout_s:g} s (trainer.dist_timeout) in a collective for "
                       f"{names}, which did not answer (stopped, hung or far slower): the run was stopped")


# --- the launcher ---------------------------------------------------------------------


class WorkerFailed(Exception):
    """A worker raised or died; the launcher stopped the others."""

    def __init__(self, rank: int, pid: int | None, exitcode: int | None, message: str, traceback: str = "",
                 user_error: bool = False, one_line: bool = False) -> None:
        self.rank, self.pid, self.exitcode = rank, pid, exitcode
        self.message, self.traceback, self.user_error = message, traceback, user_error
        self.one_line = one_line or user_error  # said in full by its message: no traceback to print
        how = "failed" if exitcode is None or exitcode >= 0 else "died"
        super().__init__(f"rank {rank} (pid {pid}) {how}: {message}; the other ranks were stopped")

    @classmethod
    def from_child(cls, error: ChildFailedError) -> "WorkerFailed":
        """The first failure; but when rank 0 failed with an error the user
        can act on (every rank said it: a sharded save's full disk), rank 0's,
        whichever rank's process ended first."""
        described = {rank: cls._describe(rank, failure) for rank, failure in error.failures.items()}
        first, _ = error.get_first_failure()
        zero = described.get(0)
        return zero if zero is not None and zero.user_error else described[first]

    @classmethod
    def _describe(cls, rank: int, failure: Any) -> "WorkerFailed":
        message, traceback = failure.message, ""
        if isinstance(message, dict):
            traceback = message.get("extraInfo", {}).get("py_callstack", "")
            message = message.get("message", str(message))
        message = str(message)
        name, _, text = message.partition(": ")
        user_error = name in _user_error_names()
        one_line = name == PeerTimeout.__name__  # a hung peer: the message says it all
        if user_error or one_line:
            message = text
        elif failure.exitcode is not None and failure.exitcode > 0 and not traceback:
            message = f"exit code {failure.exitcode} ({message})"
        return cls(rank, failure.pid, failure.exitcode, message, traceback, user_error, one_line)


def _user_error_names() -> set[str]:
    names, todo = set(), [UserError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_process_count(cfg) -> None:
    """UserError when this machine would run more training processes than it
    has cores (or, on CUDA, devices: one per process): 64 processes on 2 cores
    only compete for them, and each holds its own tables (issue 27). The
    count is trainer.nproc, or under torchrun its --nproc-per-node
    (LOCAL_WORLD_SIZE). trainer.oversubscribe=true allows more processes
    than cores (never more than devices: each rank selects its own)."""
    from recsys_cli.device import one_gpu_for_many, parse_device
    from recsys_cli.train.threads import available_cores

    tc = cfg.trainer
    if launched_by_agent():
        count, what = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])), "torchrun --nproc-per-node"
    else:
        count, what = tc.nproc, "trainer.nproc"
    if count <= 1:
        return
    device = parse_device(tc.device)
    if device.type == "cuda" and device.index is not None:
        raise UserError(one_gpu_for_many(str(tc.device)))
    if device.type == "cuda":
        devices = torch.cuda.device_count()
        if count > devices:
            raise UserError(f"{what}={count} but this machine has {devices} CUDA device(s): training runs one process "
                            f"per device (give at most {devices}, or trainer.device=cpu)")
        return
    cores = available_cores()
    if count > cores and not tc.oversubscribe:
        copies = "" if cfg.placement.sharding != "replicated" else ", each with its own copy of the tables"
        raise UserError(f"{what}={count} is more processes than the {cores} core(s) this process may use: they would "
                        f"only compete for them{copies} (give at most {cores}, or "
                        "trainer.oversubscribe=true to start them anyway)")


# --- the launcher: one machine, reachable from it alone ----------------------------------
#
# torch.distributed has no authentication: whoever reaches a rendezvous store
# or a gloo pair can join the run or feed it data. `trainer.nproc=N` starts
# its workers on this machine only, so everything it listens on is bound to
# the loopback address: the rendezvous store and the store the workers
# bootstrap from (torch's TCPStore servers listen on every interface
# whatever host they are given; these are handed a socket bound to
# 127.0.0.1), MASTER_ADDR (LaunchConfig.local_addr), and gloo's pairs
# (GLOO_SOCKET_IFNAME: the loopback interface, in the workers' environment).

LOOPBACK = "127.0.0.1"
RDZV_BACKEND = "recsys-loopback"  # c10d's dynamic rendezvous, its store servers on LOOPBACK


def loopback_store(port: int = 0) -> Any:
    """A TCPStore server listening on LOOPBACK:port only (0: a free port),
    through a socket bound there that the store takes over."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(128)
        store = dist.TCPStore(LOOPBACK, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                              multi_tenant=True, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns (and closes) the descriptor now
    return store


def _loopback_handler(params: Any) -> Any:
    """The c10d rendezvous handler (as torch's "c10d" backend builds it), but
    with its rendezvous store and the store it shares with the workers
    (created when the rendezvous completes) listening on LOOPBACK only."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    if host != LOOPBACK:
        raise ValueError(f"the {RDZV_BACKEND} rendezvous runs on {LOOPBACK}, not {host}")
    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the handler's backend must be the one the launcher asked for
            return RDZV_BACKEND

    store = loopback_store(port)
    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # The bootstrap store for the workers (torch binds it to every interface):
    # created by this hook; tests/test_distributed.py checks every listening
    # socket of a launch, so a torch that stops calling it is caught.
    setattr(handler, "_create_tcp_store_server", lambda addr, port: loopback_store(port))  # noqa: B010
    return handler


def _register_loopback_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    registry.register(RDZV_BACKEND, _loopback_handler)  # again with the same creator: a no-op


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (lo on Linux, lo0 on the BSDs), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), next((n for n in names if n.startswith("lo")), None))


def launch_config(nproc: int, monitor_interval: float = 0.1):
    """The elastic launcher's LaunchConfig for `nproc` local workers, built on
    whatever torch is installed: the fields every supported torch has, plus
    the ones newer releases added (OPTIONAL_LAUNCH_FIELDS) where it has them.
    Rendezvous, store and MASTER_ADDR on LOOPBACK (see above)."""
    from torch.distributed.launcher.api import LaunchConfig

    _register_loopback_rendezvous()
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    optional = {name: value for name, value in OPTIONAL_LAUNCH_FIELDS.items() if name in fields}
    return LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"recsys-{uuid.uuid4().hex[:12]}",
        rdzv_backend=RDZV_BACKEND, rdzv_endpoint=f"{LOOPBACK}:{free_port()}", local_addr=LOOPBACK,
        max_restarts=0, monitor_interval=monitor_interval, start_method="spawn", **optional,
    )


def _worker_environment() -> dict[str, str]:
    """What the workers' environment gets for a launch on this machine:
    gloo's pairs on the loopback interface."""
    name = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


class TeardownHung(Exception):
    """Training ended, but a worker did not exit within TEARDOWN_WAIT_S: killed."""

    def __init__(self, hung: list[tuple[int, int]], wait_s: float) -> None:
        self.hung, self.wait_s = hung, wait_s
        names = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in hung)
        super().__init__(f"{names} had not exited {wait_s:g} s after training ended (stopped or stuck while "
                         "shutting down) and was killed; the run's results were written before")


def mark(what: str) -> None:
    """In a worker of `launch`: say that this rank has reached `what`
    ("started", "trained", "done": its entrypoint returns), for the
    launcher's bound on teardown."""
    marks = os.environ.get(MARKS_ENV)
    if marks and "RANK" in os.environ:
        try:
            Path(marks, f"{what}-{os.environ['RANK']}").write_text(str(os.getpid()))
        except OSError:
            pass  # the launcher is gone: nothing waits for the mark


def exit_without_finalizing() -> None:
    """In a worker of `launch` whose entrypoint has returned: once the
    process exits, skip the interpreter's finalization (recsys_cli/fast_exit.py:
    ~2 s of CPU a worker on a 2-core machine, during which the launcher, and
    `recsys train trainer.nproc=N`, waits). Call it only after the
    entrypoint's work is done and its files are closed; a failed worker, and
    a process that is not a spawned worker, exits as before."""
    import multiprocessing

    from recsys_cli.fast_exit import exit_without_finalizing as leave_fast

    if multiprocessing.parent_process() is None:  # not a spawned worker (a test calling the entrypoint)
        return
    leave_fast()


class _TeardownWatch:
    """The launcher's watch: once any worker has marked "trained", every
    worker still running TEARDOWN_WAIT_S later without having marked "done"
    is killed (SIGKILL: a stopped process takes no other signal) and named in
    `hung`. (A worker that is done stays alive until the agent has every
    worker's return value: it is not hung.)"""

    def __init__(self, marks: Path, wait_s: float) -> None:
        import threading

        self.marks, self.wait_s = marks, wait_s
        self.hung: list[tuple[int, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="recsys-teardown-watch", daemon=True)

    def _watch(self) -> None:
        import signal

        since = None
        while not self.stop.wait(0.5):
            if since is None:
                since = time.monotonic() if any(self.marks.glob("trained-*")) else None
                continue
            if time.monotonic() - since < self.wait_s:
                continue
            for started in sorted(self.marks.glob("started-*")):
                rank, pid = int(started.name.split("-")[1]), int(started.read_text())
                if _running(pid) and not (self.marks / f"done-{rank}").exists():
                    self.hung.append((rank, pid))
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            return


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def launch(entrypoint: Callable, nproc: int, *args: Any, monitor_interval: float = 0.1,
           teardown_s: float = TEARDOWN_WAIT_S) -> dict[int, Any]:
    """Run entrypoint(*args) in `nproc` worker processes on this machine through
    torch's elastic launcher; returns {rank: return value}. A worker that raises
    or dies stops the others and raises WorkerFailed. The entrypoint must be
    importable by name (workers are spawned) and should call `init`. Workers
    that `mark` "started" and "trained" (the CLI's) have teardown_s to exit
    once one has trained, then are killed: TeardownHung names them."""
    from torch.distributed.launcher.api import elastic_launch

    config = launch_config(nproc, monitor_interval)
    marks = Path(scratch_dir("launch"))
    watch = _TeardownWatch(marks, teardown_s)
    # The agent logs every failure with its traceback; WorkerFailed carries both.
    # (and its warning that it passes a SIGTERM on: rank 0 says where the run stopped).
    names = ("torch.distributed.elastic", "torch.multiprocessing")
    quiet = [logging.getLogger(name) for name in [*names, *(n for n in logging.root.manager.loggerDict
                                                            if n.startswith(tuple(f"{m}." for m in names)))]]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    env = {**_worker_environment(), MARKS_ENV: str(marks)}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the spawned workers inherit it
    watch.thread.start()
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        if watch.hung:
            raise TeardownHung(watch.hung, teardown_s) from None
        raise WorkerFailed.from_child(e) from None
    finally:
        watch.stop.set()
        watch.thread.join()
        shutil.rmtree(marks, ignore_errors=True)
        for log, level in zip(quiet, levels):
            log.setLevel(level)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def scratch_dir(kind: str, parent: str | None = None) -> str:
    """A new directory `recsys-<kind>-<pid>-XXXX` in `parent` (the temp dir),
    made after removing the scratch directories of dead processes there
    (SCRATCH_NAMES; only the current user's, never through a symlink:
    data_tools/stale.py)."""
    from data_tools.stale import remove_dead

    parent = parent or tempfile.gettempdir()
    remove_dead(parent, SCRATCH_NAMES)
    return tempfile.mkdtemp(prefix=f"recsys-{kind}-{os.getpid()}-", dir=parent)


# --- Hydra runs under torchrun -------------------------------------------------------------


def follower_overrides(overrides: list[str]) -> list[str]:
    """Hydra overrides for a torchrun rank other than 0: compose in a scratch
    directory (removed at exit), so that only rank 0's run directory exists."""
    if os.environ.get("RANK", "0") == "0" or not launched_by_agent():
        return overrides
    scratch = scratch_dir(f"rank{os.environ['RANK']}")
    import atexit

    atexit.register(shutil.rmtree, scratch, True)
    keep = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.run.dir", "hydra.sweep.dir", "hydra.output_subdir"))]
    return [*keep, f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}", "hydra.output_subdir=null"]
