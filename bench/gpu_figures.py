"""GPU figures (BENCHMARKS.md, "GPU"): the placements and precisions side by side on one CUDA GPU.

    python -m bench.gpu_figures [--batches 2048 16384] [--rounds 3] [--steps 20] [--out DIR]

dlrm_kaggle at Criteo Kaggle's cardinalities (33.8M rows, dim 16, row-wise
Adagrad, lr 0.005) on synthetic data. For each batch size every system is built in
one process and reads the same batches from its own loader (same seed);
after a warm-up chunk each, the systems run in rounds, one chunk of
`--steps` steps each per round (order rotated), timed with the device
synchronised at both ends. A system with a cache warms up until its cache
has evicted (full, as in a long run) or --warmup-samples samples have passed;
a cache that evicted nothing while timed is marked. Systems:

  recsys placements  device, lookahead 5 % and 1 %, host, uvm, and int8 /
                     int4 tables behind a lookahead cache (5 % / 1 %)
  plain              one nn.EmbeddingBag per table, all on the device, sparse
                     gradients, the same row-wise Adagrad written out in
                     PyTorch (bench/peers/systems.py's peer, moved to CUDA)

Per system: median samples/s and its ratio to device placement, the
device bytes its tables hold (the allocator, at build) and the most its
chunks added on top (the allocator's peak in the chunk, less what was
allocated at its start), host<->device bytes per step (the runtime's copy
counters), the cache hit rate, the synchronisations a step makes
(torch.cuda.set_sync_debug_mode, counted by call site over one chunk), and
the validation AUC (the same batches for every system; at the largest batch
after each system has trained to the same epoch's end, the first that none
has passed, else after the rounds),
and the prefetcher's busy share: its seconds in the caches' prepare over the
chunk's wall time (near 100 %, the prefetcher, not the GPU, sets the pace),
beside the trainer's wait for its next prefetched batch, as a share of the
chunk.
For the lookahead systems at the largest batch, one chunk runs under
torch.profiler and gives the share of the fill copies' time that compute
kernels overlapped (bench/gpu_check.py's measure, without its artificial lag).

Writes DIR/gpu_figures.json (rewritten after every batch size) and prints a
table; `--deadline S` stops starting new work after S seconds (a device
lease is short), keeping what was measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from omegaconf import OmegaConf

from bench.peers.systems import Plain, PeerBatch, Recsys, Setup, dataset_dir, shapes_of

SYSTEMS = {
    "device": {"placement.kind": "device"},
    "lookahead 5 %": {"placement.kind": "lookahead", "placement.cache_ratio": 0.05},
    "lookahead 1 %": {"placement.kind": "lookahead", "placement.cache_ratio": 0.01},
    "host": {"placement.kind": "host"},
    "uvm": {"placement.kind": "uvm"},
    "int8 + lookahead 5 %": {"placement.kind": "lookahead", "placement.cache_ratio": 0.05, "precision.kind": "int8"},
    "int4 + lookahead 1 %": {"placement.kind": "lookahead", "placement.cache_ratio": 0.01, "precision.kind": "int4"},
}
PEER = "plain PyTorch (device)"


class CudaPlain(Plain):
    """The plain-PyTorch peer with its tables, MLPs and accumulators on the
    GPU; its loader pins each batch, the step copies it asynchronously."""

    def __init__(self, setup, shapes, data, init, device: torch.device) -> None:
        super().__init__(setup, shapes, data, init)
        self.device = device
        self.model.to(device)
        from bench.peers.systems import dense_optimizer

        # Adagrad made its state where the parameters were: made again on the device
        self.optimizer = dense_optimizer(setup, [p for n, p in self.model.named_parameters() if not n.startswith("tables.")])
        if self.rowwise:
            self.accumulators = [a.to(device) for a in self.accumulators]

    def transform(self, batch):
        peer = super().transform(batch)
        if self.device.type != "cuda":
            return peer
        per_table = [(v.pin_memory(), o.pin_memory()) for v, o in peer.inputs]
        batch.dense, batch.labels = batch.dense.pin_memory(), batch.labels.pin_memory()
        return PeerBatch(batch, per_table)

    def step(self, peer: PeerBatch) -> torch.Tensor:
        d = self.device
        moved = PeerBatch(
            type(peer.batch)(peer.batch.dense.to(d, non_blocking=True), peer.batch.sparse,
                             peer.batch.labels.to(d, non_blocking=True)),
            [(v.to(d, non_blocking=True), o.to(d, non_blocking=True)) for v, o in peer.inputs])
        return super().step(moved)


class RecsysOnGpu:
    """A recsys Trainer stepping through its own prefetched batches."""

    def __init__(self, setup: Setup, shapes, data, overrides: dict, device: str) -> None:
        cfg = setup.config()
        cfg.trainer.device = device
        cfg.trainer.epochs = 10_000  # the rounds may pass an epoch's end: the batches go on
        cfg.trainer.eval_batch_size = setup.batch_size
        for key, value in overrides.items():
            OmegaConf.update(cfg, key, value)
        self.system = Recsys(setup, shapes, data, cfg)
        self.trainer = self.system.trainer
        self.batches = self._batches()
        self.batch_wait = 0.0  # the trainer's seconds waiting for its next (prefetched) batch

    def _batches(self):
        while True:
            yield from self.trainer.epoch_batches()

    def step(self) -> torch.Tensor:
        since = time.perf_counter()
        batch = next(self.batches)
        self.batch_wait += time.perf_counter() - since
        return self.trainer.train_step(batch)

    def runtimes(self):
        return [self.trainer.runtime, *self.trainer.embeddings.runtimes()]

    def copy_bytes(self) -> dict[str, int]:
        total = {"host_to_device": 0, "device_to_host": 0}
        for r in {id(r): r for r in self.runtimes() if r is not None}.values():
            for k in total:
                total[k] += r.copy_bytes[k]
        return total

    def table_device_bytes(self) -> int | None:
        return (self.trainer.embedding_allocated or {}).get("device")

    def prepare_seconds(self) -> float:
        """The prefetcher's seconds in its caches' prepare so far (0 without a cache)."""
        return float(self.trainer.embeddings.stats().get("prepare_seconds", 0.0))

    def rows_evicted(self) -> int | None:
        """Rows its caches evicted so far (None without a cache)."""
        return self.trainer.embeddings.stats().get("rows_evicted")

    def warm_up(self, steps: int, samples: int, batch: int) -> int:
        """`steps` steps, then with a cache more until it has evicted (full: the
        steady state of a long run) or `samples` samples have passed; the steps taken."""
        taken = 0
        while taken < steps or (self.rows_evicted() == 0 and taken * batch < samples):
            self.step()
            taken += 1
        return taken

    def batch_wait_seconds(self) -> float:
        """The trainer's seconds so far waiting for its next (prefetched) batch."""
        return self.batch_wait


class PeerOnGpu:
    def __init__(self, peer: CudaPlain) -> None:
        self.peer = peer
        self.batches = self._batches()

    def _batches(self):
        loader = self.peer.loader()
        while True:  # the rounds may pass an epoch's end: the batches go on
            yield from loader

    def step(self) -> torch.Tensor:
        return self.peer.step(next(self.batches))

    def copy_bytes(self) -> dict[str, int]:
        return {"host_to_device": 0, "device_to_host": 0}  # not counted for the peer

    def prepare_seconds(self) -> float:
        return 0.0  # no cache, no prefetcher

    def rows_evicted(self) -> int | None:
        return None

    def warm_up(self, steps: int, samples: int, batch: int) -> int:
        for _ in range(steps):
            self.step()
        return steps

    def batch_wait_seconds(self) -> float:
        return 0.0  # its loader's batches are not timed

    def table_device_bytes(self) -> int:
        model = self.peer.model
        tables = sum(t.weight.numel() * t.weight.element_size() for t in model.tables)
        return tables + sum(a.numel() * a.element_size() for a in getattr(self.peer, "accumulators", []))


def timed_chunk(system, steps: int) -> dict:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        start_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    copied, prepared, waited = system.copy_bytes(), system.prepare_seconds(), system.batch_wait_seconds()
    evicted = system.rows_evicted()
    start = time.perf_counter()
    loss = None
    for _ in range(steps):
        loss = system.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    after = system.copy_bytes()
    return {"seconds": seconds, "peak_added": torch.cuda.max_memory_allocated() - start_bytes if cuda else None,
            "h2d": after["host_to_device"] - copied["host_to_device"],
            "d2h": after["device_to_host"] - copied["device_to_host"], "loss": float(loss.detach()),
            "prepare": system.prepare_seconds() - prepared,
            "batch_wait": system.batch_wait_seconds() - waited,
            "evicted": None if evicted is None else system.rows_evicted() - evicted}


def sync_sites(system, steps: int) -> dict[str, int]:
    """The synchronising calls `steps` steps make (every thread), by call site."""
    seen: Counter[str] = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                system.step()
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            seen[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return dict(seen.most_common())


def fill_overlap_share(system, steps: int, trace: Path) -> dict:
    from bench.gpu_check import fill_overlap, profiler_for

    trace.parent.mkdir(parents=True, exist_ok=True)
    prof = profiler_for(trace, 0, steps, cuda=True)
    with prof:
        for _ in range(steps):
            system.step()
            prof.step()
        torch.cuda.synchronize()
    if not trace.exists():
        return {"error": "no trace"}
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    got = fill_overlap(events)
    return {k: got.get(k) for k in ("overlapped_share", "compute_busy_share", "fill_copies", "fill_copy_us", "error")}


def epoch_end_after(systems) -> int:
    """The first end of an epoch that no system has passed."""
    systems = list(systems)
    per_epoch = systems[0].trainer.train_loader.num_batches
    return per_epoch * max(1, -(-max(s.trainer.step for s in systems) // per_epoch))


def val_auc_at(system: RecsysOnGpu, step: int | None) -> dict:
    """The validation AUC, and the step it was read at: after the system has
    trained to `step` (an epoch's end: the timing leaves the systems at early
    steps, where AUC still moves by more than the gap between precisions, and
    at different ones, since a cache warms up until it is full), else where
    the timing left it."""
    trainer = system.trainer
    while step is not None and trainer.step < step:
        system.step()
    trainer.model.eval()
    auc = trainer.evaluate("val").get("auc")
    trainer.model.train()
    return {"val_auc": auc, "val_auc_step": trainer.step}


def run_batch(batch: int, args, out: dict, started: float) -> None:
    # Adagrad at MLPerf DLRM-DCNv2's rate. At 0.05 the dense Adagrad's first steps (each weight moves
    # by about lr) took the loss into the hundreds, and one epoch's val AUC at batch 16384 spread
    # over 0.62-0.67 across seeds, against 0.7747-0.7763 at 0.005 (BENCHMARKS.md, "GPU").
    setup = Setup(rows=args.rows, cardinality_scale=args.cardinality_scale, batch_size=batch, optimizer="adagrad",
                  lr=0.005)
    device = "cpu" if args.dry else "cuda"
    cfg = setup.config()
    data = dataset_dir(cfg)
    shapes = shapes_of(cfg, data)
    built = time.perf_counter()
    systems: dict = {}
    for name in args.systems:
        systems[name] = RecsysOnGpu(setup, shapes, data, SYSTEMS[name], device)
    if args.peer:
        init = systems.get("device")
        where = torch.device("cpu") if args.dry else torch.device("cuda", torch.cuda.current_device())
        systems[PEER] = PeerOnGpu(CudaPlain(setup, shapes, data, init.system if init else None, where))
    build_seconds = time.perf_counter() - built
    names = list(systems)
    result = {"batch": batch, "build_seconds": build_seconds, "systems": {n: {"rates": []} for n in names}}
    out["batches"].append(result)
    for n in names:  # warm-up: allocator, kernels, the prefetchers' first windows, a full cache
        result["systems"][n]["warmup_steps"] = systems[n].warm_up(args.warmup, args.warmup_samples, batch)
        result["systems"][n]["evicted_before_timing"] = systems[n].rows_evicted()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    for r in range(args.rounds):
        if time.perf_counter() - started > args.deadline:
            result["stopped"] = f"deadline after round {r}"
            break
        for n in names[r % len(names):] + names[: r % len(names)]:
            got = timed_chunk(systems[n], args.steps)
            entry = result["systems"][n]
            entry["rates"].append(args.steps * batch / got["seconds"])
            # The prefetcher's share of the chunk's wall time: near 1, it sets the pace (the step waits for it).
            entry.setdefault("prepare_shares", []).append(got["prepare"] / got["seconds"])
            entry.setdefault("prepare_ms_per_step", []).append(1000 * got["prepare"] / args.steps)
            # The trainer's wait for its next prefetched batch, as a share of the chunk.
            entry.setdefault("batch_wait_shares", []).append(got["batch_wait"] / got["seconds"])
            entry["peak_added_bytes"] = max(entry.get("peak_added_bytes") or 0, got["peak_added"] or 0)
            entry["h2d_bytes_per_step"] = got["h2d"] / args.steps
            entry["d2h_bytes_per_step"] = got["d2h"] / args.steps
            entry["loss"] = got["loss"]
            if got["evicted"] is not None:
                entry["rows_evicted_timed"] = entry.get("rows_evicted_timed", 0) + got["evicted"]
        print(f"  batch {batch} round {r + 1}: " + "  ".join(
            f"{n} {result['systems'][n]['rates'][-1]:,.0f}/s" for n in names), flush=True)
    base = statistics.median(result["systems"]["device"]["rates"]) if result["systems"].get("device", {}).get(
        "rates") else None
    for n, system in systems.items():
        entry = result["systems"][n]
        if entry["rates"]:
            entry["samples_per_second"] = statistics.median(entry["rates"])
            for share in ("prepare_share", "batch_wait_share"):
                entry[share] = statistics.median(entry[share + "s"])
            entry["prepare_ms"] = statistics.median(entry["prepare_ms_per_step"])
            entry["vs_device"] = entry["samples_per_second"] / base if base else None
        entry["table_device_bytes"] = system.table_device_bytes()
        if isinstance(system, RecsysOnGpu):
            stats = system.trainer.embeddings.stats()
            entry["hit_rate"] = stats.get("hit_rate")
            entry["group_bytes_to_device"] = stats.get("bytes_to_device")
            if time.perf_counter() - started < args.deadline and not args.dry:
                entry["syncs_per_chunk"] = sync_sites(system, args.steps)
                entry["sync_steps"] = args.steps
    recsys = {n: system for n, system in systems.items() if isinstance(system, RecsysOnGpu)}
    # One step for every system's AUC: at the largest batch the end of the epoch the furthest has reached.
    at_step = epoch_end_after(recsys.values()) if batch == max(args.batches) else None
    for n, system in recsys.items():
        entry = result["systems"][n]
        if time.perf_counter() - started < args.deadline:
            entry.update(val_auc_at(system, at_step))
        if n.startswith("lookahead") and batch == max(args.batches) and not args.dry and \
                time.perf_counter() - started < args.deadline:
                entry["fill_overlap"] = fill_overlap_share(system, min(args.steps, 10),
                                                           Path(args.out) / f"trace-{batch}.json")
    write(out, args)
    del systems
    gc.collect()  # the trainers' threads and caches hold cycles: freed before the next batch size builds
    if not args.dry:
        torch.cuda.empty_cache()


def write(out: dict, args) -> None:
    path = Path(args.out) / "gpu_figures.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1, default=str))
    tmp.replace(path)


def table(out: dict) -> str:
    lines = ["| batch | system | samples/s | vs device | table device MiB | chunk peak added MiB | H2D MB/step "
             "| hit rate | prefetcher busy (fill ms/step) | trainer waits for a batch | syncs/step | val AUC (at step) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def num(v, spec: str) -> str:
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    for b in out["batches"]:
        for n, e in b["systems"].items():
            syncs = e.get("syncs_per_chunk")
            mib = {k: e[k] / 2**20 if isinstance(e.get(k), (int, float)) else None
                   for k in ("table_device_bytes", "peak_added_bytes")}
            cells = [b["batch"], n, num(e.get("samples_per_second", 0), ",.0f"), num(e.get("vs_device"), ".2f"),
                     num(mib["table_device_bytes"], ",.0f"), num(mib["peak_added_bytes"], ",.0f"),
                     num((e.get("h2d_bytes_per_step") or 0) / 1e6, ",.2f"),
                     num(e.get("hit_rate"), ".3f") + ("*" if e.get("rows_evicted_timed") == 0 else ""),
                     f"{num(e.get('prepare_share'), '.0%')} ({num(e.get('prepare_ms'), '.1f')} ms)"
                     if e.get("hit_rate") is not None else "-",
                     num(e.get("batch_wait_share"), ".0%") if e.get("hit_rate") is not None else "-",
                     num(sum(syncs.values()) / e["sync_steps"], ".1f") if syncs is not None else "-",
                     num(e.get("val_auc"), ".4f") + (f" ({e['val_auc_step']})" if "val_auc_step" in e else "")]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("\n*: the cache evicted nothing while timed (not yet full; warm-up: --warmup-samples)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_figures")
    parser.add_argument("--batches", type=int, nargs="+", default=[16384, 2048])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--no-peer", dest="peer", action="store_false")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--warmup-samples", type=int, default=400_000,
                        help="a cached system warms up until its cache evicts, or this many samples")
    parser.add_argument("--rows", type=int, default=1_500_000)
    parser.add_argument("--cardinality-scale", type=float, default=1.0)
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds after which no new work starts")
    parser.add_argument("--out", default="outputs/gpu-figures")
    parser.add_argument("--dry", action="store_true", help="on CPU at the sizes given (a smoke test of the script)")
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("gpu_figures needs a CUDA device (--dry runs it on CPU)", file=sys.stderr)
        return 4
    started = time.perf_counter()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "device": "cpu" if args.dry else torch.cuda.get_device_name(),
           "torch": torch.__version__, "command": " ".join(["python -m bench.gpu_figures", *(argv or sys.argv[1:])]),
           "args": vars(args), "batches": []}
    for batch in args.batches:
        if time.perf_counter() - started > args.deadline:
            break
        run_batch(batch, args, out, started)
        print(table(out), flush=True)
    out["seconds"] = time.perf_counter() - started
    write(out, args)
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
