"""`make gpu-check`: the device check, on one CUDA GPU (about 4 minutes, at most 6.25).

    python -m bench.gpu_check [--out DIR] [--steps 100] [--rows 400000]
        [--cardinality-scale 1.0] [--stages data,tests,...] [--dry]

Every stage runs in its own process under its own timeout, so a stage that
crashes (a CUDA error, a segfault) or hangs is recorded and the next one
still runs; the report is rewritten after every stage.

  data          generate the synthetic datasets the stages train on
  tests         pytest with RECSYS_TEST_DEVICE=cuda on the files whose tests
                take the device; the full output is kept (DIR/tests.log,
                junit XML in DIR/tests.xml)
  exact         fp32, torch.use_deterministic_algorithms(True): lookahead,
                cache and host placements train to the same per-step losses
                and tables as device placement (torch.equal)
  determinism   int8 behind the lookahead cache, deterministic algorithms:
                two runs are bit for bit the same, their final evaluations
                (dirty cached rows rounded through pinned copies) too
  sharded       placement.sharding's exchange on NCCL (gloo with --dry):
                pooled rows and the owners' row updates equal one process's
                collection, torch.equal (one GPU: a one-rank group; two or
                more: two ranks, one per GPU)
  speed: NAME   the Kaggle model (dlrm_kaggle, Kaggle cardinalities x
                --cardinality-scale) at batch 2048, one stage per placement:
                device, lookahead 5 %, lookahead 1 %, host; samples/s and
                the phase split
  overlap       torch.profiler over steps of a lookahead 5 % run whose
                compute stream sleeps 3x the host's step each step (timed
                on unlagged steps first), so the GPU sets the pace: the
                fill copies, found by their record_function range
                (`lookahead_fill`, embeddings/cache.py) through the launch
                correlation, must be 80 % under kernels on the compute
                stream; the report gives that stream's busy share beside it

`--dry` runs every stage on CPU at tiny sizes (CI runs it: the check itself
cannot rot); its overlap stage can only check that the fill ranges are
recorded on the prefetcher's thread, there are no kernels.

Writes DIR/gpu_check.json and DIR/gpu_check.md (default outputs/gpu-check).
Exit codes: 0 every stage passed; 1 a stage failed, crashed or timed out;
2 bad arguments; 3 the check itself crashed (the report holds the stages
done so far); 4 no CUDA device (and not --dry): nothing ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_CRASHED, EXIT_NO_CUDA = 1, 2, 3, 4
# The tests that take RECSYS_TEST_DEVICE: the kernels, the copy and stream
# ordering, the slot index, and test_train.py's in-process training runs (its
# command-line ones start a process each and its SIGKILL/resume test waits on
# CPU work: they test no CUDA path and would not fit the stage's budget).
TEST_FILES = ["tests/test_segment_reduce.py", "tests/test_device_paths.py", "tests/test_slot_index.py",
              "tests/test_train.py"]
TEST_SELECTION = "not cli and not sigkill and not bad_config and not roc_auc"
DRY_TEST_FILES = ["tests/test_segment_reduce.py"]
# The pytest run is stopped (SIGINT: it still writes its junit XML and log)
# this many seconds before the stage's own timeout would kill it.
TESTS_GRACE_S = 15
# The exact and determinism stages make the GPU fall behind the host: before
# each step's release, the compute stream sleeps this many cycles (~2.5 ms at
# the H200's 1.98 GHz), so fills and write-backs that the prefetcher enqueues
# meanwhile race the step's kernels unless the events order them.
LAG_CYCLES = 5_000_000
# The overlap stage keeps the compute stream busier than the host: the steps
# before OVERLAP_CALIBRATION_STEPS run unlagged and timed, then each step
# sleeps OVERLAP_LAG_FACTOR times the unlagged step's median (at least
# OVERLAP_LAG_MIN_MS). A fixed 10 ms lag ran under lookahead's 17 ms host
# step on the first H200 run, so the GPU idled a third of the time and the
# stage measured that idleness (69 % overlapped) as much as the fills.
OVERLAP_CALIBRATION_STEPS = 8
OVERLAP_LAG_FACTOR = 3.0
OVERLAP_LAG_MIN_MS = 10.0
OVERLAP_GOAL = 0.8  # the share of the fill copies' time that compute-stream kernels must overlap
EXACT_PLACEMENTS = {
    "device": {"placement.kind": "device"},
    "lookahead": {"placement.kind": "lookahead", "placement.cache_rows": 1500, "placement.window": 3},
    "cache": {"placement.kind": "cache", "placement.cache_rows": 1500},
    "host": {"placement.kind": "host"},
    "uvm": {"placement.kind": "uvm"},
}
SPEED_SYSTEMS = {
    "device": {"placement.kind": "device"},
    "lookahead 5 %": {"placement.kind": "lookahead", "placement.cache_ratio": 0.05},
    "lookahead 1 %": {"placement.kind": "lookahead", "placement.cache_ratio": 0.01},
    "host": {"placement.kind": "host"},
    "uvm": {"placement.kind": "uvm"},
}
FILL_RANGE = "lookahead_fill"  # embeddings/cache.py names its fill copies so
PROFILED_STEPS = (20, 8)  # overlap: steps 20..27 traced (dry: 2..5)


@dataclass(frozen=True)
class Sizes:
    """What the stages train on: the real check's sizes, or --dry's tiny ones."""

    exact_rows: int
    exact_scale: float
    exact_batch: int
    exact_steps: int
    speed_rows: int
    speed_scale: float
    speed_batch: int
    speed_steps: int
    overlap_scale: float
    profiled: tuple[int, int]
    test_files: tuple[str, ...]


def sizes(args) -> Sizes:
    if args.dry:
        # 1 % of the Kaggle tables at scale 0.003 is 1,000 slots: more than a batch of 32 x 26 lookups.
        return Sizes(4000, 0.0005, 64, 6, 3000, 0.003, 32, 8, 0.003, (2, 3), tuple(DRY_TEST_FILES))
    return Sizes(20000, 0.0005, 128, 40, args.rows, args.cardinality_scale, 2048, args.steps,
                 min(args.cardinality_scale, 0.1), PROFILED_STEPS, tuple(TEST_FILES))


# Per-stage timeouts (seconds, process start included); they add up to 6
# minutes, so the whole check fits twice in a 15-minute device window.
TIMEOUTS = {"data": 40, "tests": 100, "exact": 40, "determinism": 25, "sharded": 20, "overlap": 30}
SPEED_TIMEOUT = 25


def stage_names() -> list[str]:
    return ["data", "tests", "exact", "determinism", "sharded", *(f"speed: {n}" for n in SPEED_SYSTEMS), "overlap"]


def timeout_of(stage: str) -> int:
    return SPEED_TIMEOUT if stage.startswith("speed: ") else TIMEOUTS[stage]


# --- the stages (each in its own process) -----------------------------------------
def config(args, cache_dir: Path, overrides: dict, *, rows: int, scale: float, batch: int, steps: int,
           kaggle: bool):
    from omegaconf import OmegaConf

    from recsys_cli.config import TrainConfig

    cfg = OmegaConf.structured(TrainConfig)
    if kaggle:
        OmegaConf.update(cfg, "model", OmegaConf.load("configs/model/dlrm_kaggle.yaml"), merge=True)
        cfg.model.features = None
    cfg.dataset.cache_dir = str(cache_dir)
    cfg.dataset.synthetic.rows = rows
    cfg.dataset.synthetic.cardinality_scale = scale
    cfg.dataset.synthetic.split_ratios = [0.98, 0.01, 0.01]
    cfg.trainer.device = "cpu" if args.dry else "cuda"
    cfg.trainer.batch_size = batch
    cfg.trainer.max_steps = steps
    cfg.trainer.progress = False
    cfg.trainer.log_every = max(1, steps // 4)
    cfg.trainer.checkpoint_every = None
    cfg.optimizer.name = "adagrad"
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def exact_config(args, cache_dir, s: Sizes, overrides: dict):
    return config(args, cache_dir, overrides, rows=s.exact_rows, scale=s.exact_scale, batch=s.exact_batch,
                  steps=s.exact_steps, kaggle=False)


def speed_config(args, cache_dir, s: Sizes, overrides: dict, scale: float | None = None):
    return config(args, cache_dir, overrides, rows=s.speed_rows, scale=s.speed_scale if scale is None else scale,
                  batch=s.speed_batch, steps=s.speed_steps, kaggle=True)


def train(cfg, record_losses: bool = False, lag_cycles: int = 0):
    """Train `cfg`; with record_losses, trainer.step_losses holds every step's
    loss, read after the run (a .item() per step would let the GPU never fall
    behind). lag_cycles: the compute stream sleeps that long before every
    release (CUDA only), so the device runs behind the host."""
    import torch

    from recsys_cli.train.trainer import Trainer

    trainer = Trainer(cfg)
    losses: list = []
    if record_losses:
        step = trainer.train_step

        def recorded(batch):
            loss = step(batch)
            losses.append(loss.detach().clone())
            return loss

        trainer.train_step = recorded
    if lag_cycles and torch.cuda.is_available() and str(cfg.trainer.device).startswith("cuda"):
        release = trainer.embeddings.release

        def late_release(batch):
            torch.cuda._sleep(lag_cycles)
            release(batch)

        trainer.embeddings.release = late_release
    summary = trainer.fit()
    trainer.step_losses = [float(v) for v in torch.stack(losses).cpu()] if losses else []
    return trainer, summary


def deterministic() -> None:
    """The exactness stages compare bits: no nondeterministic kernel may run
    (one that has no deterministic version raises, and the stage fails)."""
    from recsys_cli.determinism import enable

    enable()


def stage_data(args, work_dir: Path, cache_dir: Path) -> dict:
    from recsys_cli.train.training_data import resolve_dataset

    s = sizes(args)
    made = []
    for cfg in (exact_config(args, cache_dir, s, {}), speed_config(args, cache_dir, s, {}),
                speed_config(args, cache_dir, s, {}, scale=s.overlap_scale)):
        made.append(str(resolve_dataset(cfg.dataset)))
    return {"ok": True, "datasets": sorted(set(made))}


def stage_tests(args, work_dir: Path, cache_dir: Path) -> dict:
    s = sizes(args)
    env = dict(os.environ, RECSYS_TEST_DEVICE="cpu" if args.dry else "cuda")
    junit, log = work_dir / "tests.xml", work_dir / "tests.log"
    select = [] if args.dry else ["-k", TEST_SELECTION]
    deadline = TIMEOUTS["tests"] - TESTS_GRACE_S
    with open(log, "w") as out:
        pytest = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE",
                                   f"--junitxml={junit}", *select, *s.test_files],
                                  env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            pytest.wait(timeout=deadline)
        except subprocess.TimeoutExpired:  # stopped as Ctrl-C would: pytest still writes its junit and summary
            pytest.send_signal(signal.SIGINT)
            try:
                pytest.wait(timeout=TESTS_GRACE_S - 5)
            except subprocess.TimeoutExpired:
                pytest.kill()
                pytest.wait()
    done = pytest
    counts = junit_counts(junit) if junit.exists() else {"tests": 0, "failures": 0, "errors": 0, "skipped": 0,
                                                          "failed": []}
    ran = counts["tests"] - counts["skipped"]
    ok = done.returncode == 0 and counts["failures"] == 0 and counts["errors"] == 0 and ran > 0
    summary = (f"{ran - counts['failures'] - counts['errors']} passed, {counts['failures']} failed, "
               f"{counts['errors']} errors, {counts['skipped']} skipped")
    if done.returncode == 2 and "KeyboardInterrupt" in log.read_text(errors="replace"):
        summary += f"; stopped after {deadline} s"
    return {"ok": ok, "files": list(s.test_files), "summary": summary, "pytest_exit_code": done.returncode,
            "failed": counts["failed"], "junit": str(junit), "log": str(log)}


def junit_counts(path: Path) -> dict:
    """Totals and failed test ids from pytest's junit XML."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["failed"] = failed
    return counts


def stage_exact(args, work_dir: Path, cache_dir: Path) -> dict:
    import torch

    deterministic()
    s = sizes(args)
    ref, _ = train(exact_config(args, cache_dir, s, EXACT_PLACEMENTS["device"]), record_losses=True,
                   lag_cycles=LAG_CYCLES)
    ref_tables = ref.embeddings.table_state()
    checks = {}
    for name, overrides in EXACT_PLACEMENTS.items():
        if name == "device":
            continue
        got, _ = train(exact_config(args, cache_dir, s, overrides), record_losses=True, lag_cycles=LAG_CYCLES)
        tables = got.embeddings.table_state()
        checks[f"fp32 {name} == device"] = (got.step_losses == ref.step_losses and all(
            torch.equal(tables[t]["weights"], ref_tables[t]["weights"]) for t in ref_tables))
    return {"ok": all(checks.values()), "checks": checks, "steps": s.exact_steps, "lag_cycles": LAG_CYCLES}


def stage_determinism(args, work_dir: Path, cache_dir: Path) -> dict:
    import torch

    deterministic()
    s = sizes(args)
    runs = []
    for _ in range(2):
        got, summary = train(exact_config(args, cache_dir, s, {**EXACT_PLACEMENTS["lookahead"], "precision.kind": "int8"}),
                             record_losses=True, lag_cycles=LAG_CYCLES)
        runs.append((got.step_losses, got.embeddings.table_state(), summary.get("final")))
    (l1, t1, e1), (l2, t2, e2) = runs
    same = l1 == l2 and all(torch.equal(t1[t][k], t2[t][k]) for t in t1 for k in t1[t]
                            if isinstance(t1[t][k], torch.Tensor))
    # The final evaluations read the cache's dirty rows rounded on the host, through pinned
    # buffers (CachedGroup.read_as_saved): a copy read before it landed differs between runs.
    checks = {"int8 lookahead run == run": same, "int8 lookahead evaluation == evaluation": bool(e1) and e1 == e2}
    return {"ok": all(checks.values()), "checks": checks, "steps": s.exact_steps, "lag_cycles": LAG_CYCLES,
            "final": e1}


def stage_speed(system: str):
    def run(args, work_dir: Path, cache_dir: Path) -> dict:
        from recsys_cli.errors import UserError

        s = sizes(args)
        try:
            _, summary = train(speed_config(args, cache_dir, s, SPEED_SYSTEMS[system]))
        except UserError as e:  # e.g. a 1 % cache smaller than one batch at a small --cardinality-scale
            return {"ok": False, "error": str(e)}
        copies = summary["host_device_copies"] or {}
        pageable = copies.get("host_to_device_pageable", 0) + copies.get("device_to_host_pageable", 0)
        return {
            # a pageable copy is synchronous on CUDA: the step waited for the device
            "ok": pageable == 0,
            "error": f"{pageable} pageable copies between host and device" if pageable else None,
            "samples_per_second": summary["samples_per_second"],
            "phase_seconds": summary["phase_seconds"],
            "peak_device_bytes": summary["peak_device_bytes"],
            "embedding_bytes_allocated": summary["embedding_bytes_allocated"],
            "pageable_host_to_device_copies": summary["pageable_host_to_device_copies"],
            "pageable_copy_sites": summary.get("pageable_copy_sites"),
            "host_device_copies": summary["host_device_copies"],
            "cache_hit_rate": (summary.get("cache") or {}).get("hit_rate"),
        }

    return run


def profiler_for(trace: Path, first: int, active: int, cuda: bool):
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    kwargs = {}
    try:  # the fills run on the prefetcher's thread; ranges there are recorded only with this
        from torch._C._profiler import _ExperimentalConfig

        kwargs["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):  # an older torch: the stage then finds no fill ranges and says so
        pass
    return torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=first, warmup=0, active=active, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)), **kwargs,
    )


def stage_overlap(args, work_dir: Path, cache_dir: Path) -> dict:
    from recsys_cli.train.trainer import Trainer

    s = sizes(args)
    first, active = s.profiled
    cfg = speed_config(args, cache_dir, s, SPEED_SYSTEMS["lookahead 5 %"], scale=s.overlap_scale)
    cfg.trainer.max_steps = max(cfg.trainer.max_steps, first + active + 2)
    cycles_per_ms = None if args.dry else sleep_cycles_per_ms()
    trainer = Trainer(cfg)
    trace = work_dir / TRACE
    prof = profiler_for(trace, first, active, cuda=not args.dry)
    step = trainer.train_step
    starts: list[float] = []
    lag: dict = {"cycles": 0}

    def traced(batch):
        # The compute stream busy as on a model whose step outlasts the
        # host's (at batch 2048 on an H200 the host is the bottleneck and the
        # GPU idles, so "overlapped with kernels" would measure idleness):
        # fills on a side stream then overlap this work; fills serialised
        # with the compute stream cannot.
        starts.append(time.perf_counter())
        if len(starts) == OVERLAP_CALIBRATION_STEPS + 1 and cycles_per_ms is not None:
            lag["host_step_ms"] = 1000 * unlagged_step_seconds(starts)
            lag["lag_ms"] = overlap_lag_ms(lag["host_step_ms"])
            lag["cycles"] = int(lag["lag_ms"] * cycles_per_ms)
        if lag["cycles"]:
            import torch

            torch.cuda._sleep(lag["cycles"])
        loss = step(batch)
        prof.step()
        return loss

    trainer.train_step = traced
    with prof:
        trainer.fit()
    if not trace.exists():
        return {"ok": False, "error": "the profiler wrote no trace"}
    events = json.loads(trace.read_text())["traceEvents"]
    if args.dry:
        return fill_ranges_recorded(events)
    return {**fill_overlap(events), "lag": {**lag, "sleep_cycles_per_ms": cycles_per_ms}}


def unlagged_step_seconds(starts: list[float]) -> float:
    """The median time between the starts of the unlagged steps, the first
    two left out (their allocations and first fills)."""
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    return statistics.median(gaps[2:] or gaps)


def overlap_lag_ms(host_step_ms: float) -> float:
    """The compute-stream work per step that leaves the GPU the bottleneck,
    with room for the profiler's own cost on the host."""
    return max(OVERLAP_LAG_MIN_MS, OVERLAP_LAG_FACTOR * host_step_ms)


def sleep_cycles_per_ms() -> float:
    """torch.cuda._sleep's cycles per millisecond on this GPU, timed by events."""
    import torch

    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # its first launch loads the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def fill_ranges_recorded(events: list[dict]) -> dict:
    """--dry: the lookahead fills' ranges are in the trace, on a thread of their own."""
    fills = [e for e in events if e.get("ph") == "X" and e.get("name") == FILL_RANGE]
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep")]
    step_threads = {e.get("tid") for e in steps}
    fill_threads = {e.get("tid") for e in fills}
    ok = bool(fills) and bool(fill_threads - step_threads)
    return {"ok": ok, "fill_ranges": len(fills), "fill_threads": len(fill_threads),
            "note": "CPU: no kernels; checks the fill ranges are recorded on the prefetcher's thread"}


def fill_overlap(events: list[dict]) -> dict:
    """From a chrome trace of a CUDA run: the host-to-device copies launched
    inside `lookahead_fill` ranges (matched through the launch's correlation
    id), and the share of their time that kernels on the compute stream (the
    one with the most kernel time) overlap."""
    fills: dict[object, list[tuple[float, float]]] = {}
    launches, kernels, copies = [], {}, []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, args = e.get("cat"), e.get("args") or {}
        if e.get("name") == FILL_RANGE and cat != "gpu_user_annotation":
            fills.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e["dur"]))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches.append((e.get("tid"), e["ts"], args["correlation"]))
        elif cat == "kernel":
            kernels.setdefault(args.get("stream"), []).append((e["ts"], e["ts"] + e["dur"]))
        elif cat == "gpu_memcpy" and "HtoD" in e.get("name", ""):
            copies.append((args.get("stream"), e["ts"], e["ts"] + e["dur"], args.get("correlation")))
    if not kernels:
        return {"ok": False, "error": "no kernels in the trace"}
    filled = {c for tid, ts, c in launches if any(a <= ts <= b for a, b in fills.get(tid, ()))}
    compute = max(kernels, key=lambda st: sum(b - a for a, b in kernels[st]))
    busy = sorted(kernels[compute])
    fill_copies = [(st, a, b) for st, a, b, c in copies if c in filled]
    total = sum(b - a for _, a, b in fill_copies)
    covered = sum(_covered(a, b, busy) for st, a, b in fill_copies if st != compute)
    share = covered / total if total else 0.0
    on_compute = sum(b - a for st, a, b in fill_copies if st == compute)
    # Fills that run whenever they are ready overlap about this share even if
    # nothing orders them: the reading to set the overlapped share against.
    busy_share = sum(b - a for a, b in busy) / max(busy[-1][1] - busy[0][0], 1e-9)
    result = {"fill_ranges": sum(len(r) for r in fills.values()), "fill_copies": len(fill_copies),
              "fill_copy_us": total, "fill_copy_us_on_compute_stream": on_compute,
              "compute_stream": compute, "compute_busy_share": busy_share, "overlapped_share": share}
    if not fill_copies:
        result["error"] = "no host-to-device copy was launched inside a lookahead_fill range"
    elif share < OVERLAP_GOAL:
        result["error"] = (f"{share:.0%} of the fill copies' time overlapped compute (goal {OVERLAP_GOAL:.0%}); "
                           f"the compute stream was busy {busy_share:.0%} of the traced steps")
    return {"ok": bool(fill_copies) and share >= OVERLAP_GOAL, **result}


def _covered(a: float, b: float, busy: list[tuple[float, float]]) -> float:
    covered = 0.0
    for ka, kb in busy:
        if kb <= a:
            continue
        if ka >= b:
            break
        covered += min(b, kb) - max(a, ka)
    return covered


# --- sharded tables: the exchange, exact (also run by tests/test_sharding.py on gloo) ----------
SHARDED_CHECK_TABLES = (["a", "b", "c"], [50, 7, 300], 4)  # features, rows, dim
SHARDED_CHECK_BATCH = 16


def _check_batch():
    import torch

    from recsys_cli.data.jagged import KeyedJaggedTensor

    features, vocab, _ = SHARDED_CHECK_TABLES
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 4, (len(features) * SHARDED_CHECK_BATCH,), generator=g)
    per_key = lengths.view(len(features), SHARDED_CHECK_BATCH).sum(1)
    values = torch.cat([torch.randint(0, n, (int(k),), generator=g) for n, k in zip(vocab, per_key)])
    return KeyedJaggedTensor(features, values, lengths, SHARDED_CHECK_BATCH)


def _slice(kjt, lo: int, hi: int):
    import torch

    from recsys_cli.data.jagged import KeyedJaggedTensor

    lengths = kjt.lengths.view(len(kjt.keys), kjt.stride)
    chunks = torch.split(kjt.values, lengths.sum(1).tolist())
    values, out_lengths = [], []
    for k in range(len(kjt.keys)):
        start = int(lengths[k, :lo].sum())
        values.append(chunks[k][start : start + int(lengths[k, lo:hi].sum())])
        out_lengths.append(lengths[k, lo:hi])
    return KeyedJaggedTensor(kjt.keys, torch.cat(values), torch.cat(out_lengths), hi - lo)


def sharded_exchange_checks(device) -> dict[str, bool]:
    """In every rank of an initialised process group: one process's
    collection and the sharded one (table- and row-wise) on one batch. The
    pooled rows of this rank's slice equal the whole batch's (torch.equal
    table-wise; row-wise a bag split over shards adds partial sums in rank
    order), and the rows each owner updates from every rank's pooled
    gradients equal one process's update from their concatenation divided
    by the world size (torch.equal)."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from recsys_cli.data.batch import Batch
    from recsys_cli.embeddings.optim import RowOptimizer
    from recsys_cli.embeddings.placement import build_embeddings
    from recsys_cli.embeddings.sharded import build_sharded_embeddings

    features, vocab, dim = SHARDED_CHECK_TABLES
    batch = SHARDED_CHECK_BATCH
    rank, world = dist.get_rank(), dist.get_world_size()
    place = SimpleNamespace(kind="device", device_max_rows=None, overrides={}, cache_rows=None, cache_ratio=0.05,
                            window=4, policy="lru", sharding="row", device_memory_budget=None)
    prec = SimpleNamespace(kind="fp32", rounding="stochastic", cache_ratio=None, policy="lru")
    out = {}
    for sharding in ("table", "row"):
        place.sharding = sharding
        whole = build_embeddings(features, vocab, dim, place, prec, RowOptimizer("sgd", 0.5), device, 7)
        sharded = build_sharded_embeddings(features, vocab, dim, place, prec, RowOptimizer("sgd", 0.5), device, 7,
                                           rank, world, None)
        kjt = _check_batch()
        lo, hi = rank * batch // world, (rank + 1) * batch // world
        mine = Batch(torch.zeros(hi - lo, 1), _slice(kjt, lo, hi), torch.zeros(hi - lo))
        mine = sharded.route(sharded.plan_batch(mine), None).to(device)
        pooled = sharded(mine)
        everything = whole.plan_batch(Batch(torch.zeros(batch, 1), kjt, torch.zeros(batch))).to(device)
        reference = whole(everything)
        if sharding == "table":
            out["table: pooled"] = torch.equal(pooled, reference[lo:hi])
        else:
            out["row: pooled"] = torch.allclose(pooled, reference[lo:hi], rtol=1e-6, atol=1e-7)
        grad = torch.randn(batch, len(features), dim, generator=torch.Generator().manual_seed(11)).to(device)
        pooled.backward(grad[lo:hi])
        reference.backward(grad / world)
        sharded.step()
        whole.step()
        for group in sharded.groups:
            for t in group.tables:
                a = group.row_offset[t.name]
                mine_rows = group.read(torch.arange(a, a + t.num_rows, device=device))
                wg = next(w for w in whole.groups if t.name in w.row_offset)
                b = wg.row_offset[t.name] + t.first_row
                out[f"{sharding}: rows of {t.name}[{t.first_row}:]"] = torch.equal(
                    mine_rows, wg.read(torch.arange(b, b + t.num_rows, device=device)))
    return out


def stage_sharded(args, work_dir: Path, cache_dir: Path) -> dict:
    """The sharded exchange on the run's backend: NCCL on CUDA, gloo with --dry.
    One GPU: a one-rank NCCL group (NCCL takes one rank per device) runs the
    exchange checks on the device; two or more: two ranks, one per GPU."""
    import torch
    import torch.distributed as dist

    from recsys_cli.train.distributed import free_port

    if args.dry or torch.cuda.device_count() < 2:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        backend = "gloo" if args.dry else "nccl"
        device = torch.device("cpu") if args.dry else torch.device("cuda", 0)
        if device.type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend)
        try:
            checks = sharded_exchange_checks(device)
        finally:
            dist.destroy_process_group()
        return {"ok": all(checks.values()), "checks": checks, "backend": backend, "ranks": 1}
    from recsys_cli.train import distributed

    ranks = distributed.launch(_sharded_rank, 2)
    checks = {f"rank {r}: {k}": v for r, got in ranks.items() for k, v in got.items()}
    return {"ok": all(checks.values()), "checks": checks, "backend": "nccl", "ranks": 2}


def _sharded_rank() -> dict[str, bool]:
    import torch

    from recsys_cli.train import distributed

    ctx = distributed.init(timeout_s=60, device="cuda")
    try:
        return sharded_exchange_checks(torch.device("cuda", ctx.local_rank))
    finally:
        distributed.teardown()


def stage_function(stage: str):
    if stage.startswith("speed: "):
        return stage_speed(stage[len("speed: "):])
    return {"data": stage_data, "tests": stage_tests, "exact": stage_exact, "determinism": stage_determinism,
            "sharded": stage_sharded, "overlap": stage_overlap}[stage]


def run_stage_here(args) -> None:
    """A child: run one stage, write its result (the parent reads it)."""
    import torch

    work_dir, cache_dir = Path(args.work), Path(args.cache_dir)
    start = time.perf_counter()
    result = stage_function(args.stage)(args, work_dir, cache_dir)
    result["device"] = "cpu" if args.dry else torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    result["stage_seconds"] = time.perf_counter() - start
    tmp = Path(args.result + ".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(args.result)


# --- the parent: every stage in its own process -------------------------------------
def run_stage(stage: str, args, work_dir: Path, cache_dir: Path, passthrough: list[str]) -> dict:
    slug = stage.replace(": ", "-").replace(" %", "pct").replace(" ", "-")
    result_path, log_path = work_dir / f"stage-{slug}.json", work_dir / f"stage-{slug}.log"
    result_path.unlink(missing_ok=True)
    timeout = timeout_of(stage)
    command = [sys.executable, "-m", "bench.gpu_check", "--stage", stage, "--result", str(result_path),
               "--cache-dir", str(cache_dir), *passthrough]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the stage and whatever it started
            child.wait()
            code = None
    seconds = time.perf_counter() - start
    entry = {"name": stage, "seconds": round(seconds, 2), "timeout_s": timeout, "log": str(log_path)}
    if code is None:
        return {**entry, "status": "timed out", "ok": False, "error": f"timed out after {timeout} s"}
    if code != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return {**entry, "status": "crashed", "ok": False, "error": f"exit code {code}: {tail[0]}"}
    details = json.loads(result_path.read_text())
    ok = bool(details.pop("ok"))
    return {**entry, "status": "passed" if ok else "failed", "ok": ok, "error": details.pop("error", None),
            "details": details}


LOGS_TARBALL = "gpu_check_logs.tar.gz"
TRACE = "lookahead_trace.json"


def write_report(report: dict, out_dir: Path, work_dir: Path | None = None, keep_trace: bool = False) -> None:
    """The report in `out_dir`: gpu_check.json, gpu_check.md and one tarball of
    every stage's log and result, pytest's log and junit XML (and the
    overlap stage's trace, with keep_trace), so it comes back whole through
    a channel that carries a few files."""
    for name, text in (("gpu_check.json", json.dumps(report, indent=1, default=str)), ("gpu_check.md", markdown(report))):
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out_dir / name)
    if work_dir is None or not work_dir.is_dir():
        return
    tmp = out_dir / (LOGS_TARBALL + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(work_dir.iterdir()):
            if path.is_file() and (keep_trace or path.name != TRACE):
                tar.add(path, arcname=f"gpu_check_logs/{path.name}")
    tmp.replace(out_dir / LOGS_TARBALL)


def markdown(report: dict) -> str:
    stages = report.get("stages", [])
    verdict = "PASSED" if report.get("ok") else ("INCOMPLETE" if report.get("error") else "FAILED")
    lines = [f"# gpu-check {report['date']} on {report.get('device') or '?'}: {verdict}", "",
             f"torch {report.get('torch')}, {'dry run on CPU (tiny sizes)' if report.get('dry') else 'CUDA'}, "
             f"{report.get('seconds', 0):.0f} s", ""]
    if report.get("error"):
        lines += [f"**The check crashed**: {report['error']}", ""]
    lines += ["| stage | result | seconds (limit) | what it found |", "|---|---|---|---|"]
    for st in stages:
        lines.append(f"| {st['name']} | {st['status']} | {st['seconds']:.1f} ({st['timeout_s']}) | {_found(st)} |")
    speed = [st for st in stages if st["name"].startswith("speed: ") and st.get("details", {}).get(
        "samples_per_second")]
    if speed:
        base = next((st["details"]["samples_per_second"] for st in speed if st["name"] == "speed: device"), 0)
        lines += ["", "| placement (dlrm_kaggle) | samples/s | vs device | peak device | pageable copies to / from device |",
                  "|---|---|---|---|---|"]
        for st in speed:
            d = st["details"]
            rate = d["samples_per_second"] or 0
            lines.append(f"| {st['name'][len('speed: '):]} | {rate:,.0f} | {rate / base if base else 0:.2f} | "
                         f"{(d.get('peak_device_bytes') or 0) / 2**20:,.0f} MiB | "
                         f"{_pageable(d)} |")
    failed = [t for st in stages for t in st.get("details", {}).get("failed", [])]
    if failed:
        lines += ["", "Failed tests (full output in tests.log, junit XML in tests.xml):", ""]
        lines += [f"* {t}" for t in failed[:30]]
    return "\n".join(lines) + "\n"


def _pageable(d: dict) -> str:
    """Pageable copies (synchronous on CUDA) each way, from summary.json's host_device_copies."""
    copies = d.get("host_device_copies")
    if not copies:
        return "-"
    return f"{copies['host_to_device_pageable']} / {copies['device_to_host_pageable']}"


def _found(st: dict) -> str:
    d = st.get("details", {})
    if st.get("error"):
        return str(st["error"]).replace("|", "/")[:200]
    if "summary" in d:
        return d["summary"]
    if "checks" in d:
        return "; ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in d["checks"].items())
    if "overlapped_share" in d:
        lag = d.get("lag") or {}
        paced = f"; GPU paced by a {lag['lag_ms']:.0f} ms lag a step (host step {lag['host_step_ms']:.1f} ms)" \
            if lag.get("lag_ms") else ""
        return (f"{d['fill_copies']} fill copies ({d['fill_copy_us'] / 1e3:.1f} ms), "
                f"{d['overlapped_share']:.0%} under compute-stream kernels, busy "
                f"{d['compute_busy_share']:.0%} of the traced steps{paced}")
    if "fill_ranges" in d:
        return f"{d['fill_ranges']} {FILL_RANGE} ranges on {d['fill_threads']} thread(s); {d.get('note', '')}"
    if "samples_per_second" in d:
        return f"{d['samples_per_second']:,.0f} samples/s"
    if "datasets" in d:
        return f"{len(d['datasets'])} dataset(s)"
    return ""


def launch_config_fields() -> list[str] | None:
    """The installed torch's LaunchConfig fields (train/distributed.py builds
    one on whatever release is installed; the report records the box's)."""
    try:
        import dataclasses

        from torch.distributed.launcher.api import LaunchConfig

        return [f.name for f in dataclasses.fields(LaunchConfig)]
    except Exception:  # noqa: BLE001 - a record, never a reason to stop
        return None


def check(args, passthrough: list[str]) -> int:
    import torch

    out_dir = Path(args.out)
    if not args.dry and not torch.cuda.is_available():
        print("gpu-check needs a CUDA device; none is available (it has not run; `--dry` runs it on CPU)",
              file=sys.stderr)
        return EXIT_NO_CUDA
    names = stage_names()
    chosen = names if not args.stages else [n.strip() for n in args.stages.split(",")]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        print(f"--stages: unknown stage(s) {', '.join(unknown)}; the stages are: {', '.join(names)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out_dir.mkdir(parents=True, exist_ok=True)
    given_cache = args.cache_dir or os.environ.get("RECSYS_CACHE")
    # The generated datasets: a folder of the check's own is removed at the end (nothing in it outlives the check).
    cache_dir = Path(given_cache or tempfile.mkdtemp(prefix="recsys-gpu-check-"))
    # The stages' logs, results and trace: apart from the report, which is a few files (write_report).
    # Kept: the trace stays here, on the box (--keep-trace puts it in the report).
    work_dir = Path(args.work or tempfile.mkdtemp(prefix="recsys-gpu-check-work-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    passthrough = [*passthrough, "--work", str(work_dir)]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": None, "torch": torch.__version__,
              "python": sys.executable, "dry": args.dry, "args": vars(args), "work_dir": str(work_dir),
              "launch_config_fields": launch_config_fields(), "stages": [], "ok": False}
    start = time.perf_counter()
    try:
        for stage in chosen:
            entry = run_stage(stage, args, work_dir, cache_dir, passthrough)
            report["stages"].append(entry)
            report["device"] = report["device"] or entry.get("details", {}).get("device")
            report["seconds"] = time.perf_counter() - start
            write_report(report, out_dir, work_dir, args.keep_trace)
            print(f"{stage:>22}: {entry['status']} ({entry['seconds']:.1f} s) {_found(entry)}", flush=True)
        report["ok"] = all(st["ok"] for st in report["stages"])
    except Exception as e:  # the check itself, not a stage: keep what was done
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()
    report["seconds"] = time.perf_counter() - start
    code = EXIT_CRASHED if report.get("error") else (0 if report["ok"] else EXIT_FAILED)
    report["exit_code"] = code
    write_report(report, out_dir, work_dir, args.keep_trace)
    if not given_cache:
        shutil.rmtree(cache_dir, ignore_errors=True)
    print(markdown(report))
    return code


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check")
    parser.add_argument("--out", default="outputs/gpu-check")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--cardinality-scale", type=float, default=1.0)
    parser.add_argument("--stages", default=None, help="comma-separated subset, e.g. exact,overlap")
    parser.add_argument("--dry", action="store_true", help="every stage on CPU at tiny sizes (CI)")
    parser.add_argument("--cache-dir", default=None, help="where the synthetic datasets go")
    parser.add_argument("--work", default=None,
                        help="where the stages' logs, results and the profiler's trace go (default: a temporary "
                        "folder); --out gets the report and one tarball of these")
    parser.add_argument("--keep-trace", action="store_true", help="put the overlap stage's trace in the tarball")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # a child: run this stage
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.stage is not None:
        run_stage_here(args)
        return
    # What every child gets: the sizes and the output folder, never --stages.
    passthrough = ["--out", args.out, "--steps", str(args.steps), "--rows", str(args.rows),
                   "--cardinality-scale", str(args.cardinality_scale), *(["--dry"] if args.dry else [])]
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS under deterministic algorithms
    try:
        code = check(args, passthrough)
    except Exception:  # before the report exists
        traceback.print_exc()
        code = EXIT_CRASHED
    sys.exit(code)


if __name__ == "__main__":
    main()
