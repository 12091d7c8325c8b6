"""Disk tier benchmark (issue 17): `disk` against `host` placement.

    .venv/bin/python -m bench.disk_bench [--rows 200000] [--scale 1.0] [--steps 200] [--record]
    .venv/bin/python -m bench.disk_bench --large [--large-scale 12] [--large-steps 2000]
        [--large-precisions fp32,int8] [--record]
    .venv/bin/python -m bench.disk_bench --io [--io-rows 8000000] [--io-reads 4000] [--record]

1. Same model (dlrm_kaggle), same data (synthetic, Kaggle cardinalities x
   --scale), tables that fit in memory: `+placement=disk` with a host cache of
   5 % of the rows (behind the usual 5 % lookahead cache, window 4) against
   `+placement=host`. Both trainers live in one process and train in
   alternating chunks of --chunk steps, so the machine's noise hits both
   alike; the ratio is disk's samples/s over host's. Also: disk bytes read
   per step, read amplification, host cache hit rate, seconds the trainer
   waited on the store.
2. --large: tables larger than memory (Kaggle cardinalities x --large-scale
   at dim 16 with row-wise Adagrad state; x12 is 406M rows, 27.6 GB: the
   generator grows the profile past Kaggle's above 1), `+placement=disk` under
   placement.host_cache_ratio chosen for a host budget, fp32 and int8, each in
   its own process (peak RSS): throughput, peak RSS, checkpoint time and size.
   Long (tens of minutes at x12): run it with a reduced --large-scale on a
   shared machine and say so.
3. --io: the store's reads by I/O threads (placement.disk_io_threads): a
   DiskRowStore of --io-rows rows (dim 16, Adagrad state, no host cache);
   each round reads the same --io-reads scattered rows (more than a page
   apart: one pread each) with each thread count in turn, first with the
   file's pages dropped from the page cache before each read
   (posix_fadvise DONTNEED, this file only), then warm (the page cache
   serves them: the store must not lose time to its threads there). Rows
   read per second, and each count's ratio to one thread, median over
   rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from omegaconf import OmegaConf

from bench.train_bench import recsys_config
from recsys_cli.train.trainer import Trainer


def config(rows: int, scale: float, batch: int, steps: int, placement: dict, disk_path: str | None = None):
    cfg = recsys_config(rows, batch, steps, placement)
    cfg.dataset.synthetic.cardinality_scale = scale
    cfg.trainer.eval_every = 0
    cfg.trainer.checkpoint_every = 0
    if disk_path:
        cfg.placement.disk_path = disk_path
    return cfg


def alternate(trainers: dict[str, Trainer], steps: int, chunk: int) -> dict[str, float]:
    """Train every trainer `steps` steps in alternating chunks; seconds each spent."""
    feeds = {name: t.epoch_batches() for name, t in trainers.items()}
    seconds = dict.fromkeys(trainers, 0.0)
    for name, t in trainers.items():  # warm-up: the loaders and prefetchers start, the window fills
        for _ in range(min(10, steps // 4)):
            t.train_step(next(feeds[name]))
            t.feed.passed(t.step)
    done = 0
    while done < steps:
        n = min(chunk, steps - done)
        for name, t in trainers.items():
            start = time.perf_counter()
            for _ in range(n):
                t.train_step(next(feeds[name]))
                t.feed.passed(t.step)
            seconds[name] += time.perf_counter() - start
        done += n
    for s in feeds.values():
        s.close()
    return seconds


def benchmark_1(rows: int, scale: float, batch: int, steps: int, chunk: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="disk-bench-") as disk_path:
        warm = 10
        total = steps + min(warm, steps // 4)
        host = Trainer(config(rows, scale, batch, total, {"kind": "host"}))
        disk = Trainer(config(rows, scale, batch, total, {"kind": "disk", "cache_ratio": 0.05, "window": 4,
                                                          "host_cache_ratio": 0.05}, disk_path))
        group = next(g for g in disk.embeddings.groups if g.kind == "lookahead")
        before = dict(group.stats())
        seconds = alternate({"host": host, "disk": disk}, steps, chunk)
        after = group.stats()
    delta = {k: after[k] - before.get(k, 0) for k in ("disk_bytes_read", "disk_bytes_written", "disk_bytes_needed",
                                                      "host_cache_hits", "host_cache_misses", "disk_wait_seconds",
                                                      "disk_io_seconds")}
    host_rate, disk_rate = steps * batch / seconds["host"], steps * batch / seconds["disk"]
    table_mib = host.embeddings.memory()["table"] / 2**20
    lookups = delta["host_cache_hits"] + delta["host_cache_misses"]
    row = {
        "scale": scale, "table MiB": table_mib, "batch": batch, "steps": steps,
        "host samples/s": host_rate, "disk samples/s": disk_rate, "disk / host": disk_rate / host_rate,
        "disk MiB read/step": delta["disk_bytes_read"] / steps / 2**20,
        "disk MiB written/step": delta["disk_bytes_written"] / steps / 2**20,
        "read amplification": delta["disk_bytes_read"] / max(delta["disk_bytes_needed"], 1),
        "host cache hit rate": delta["host_cache_hits"] / max(lookups, 1),
        "disk I/O ms/step (prefetch thread)": 1000 * delta["disk_io_seconds"] / steps,
        "trainer waited ms/step": 1000 * delta["disk_wait_seconds"] / steps,
        "load avg": os.getloadavg()[0],
    }
    print(row, flush=True)
    return [row]


LARGE_CHILD = """
import json, resource, sys, time
from bench.disk_bench import config
from recsys_cli.train.trainer import Trainer
from recsys_cli import checkpoints as ckpt
from pathlib import Path
rows, scale, batch, steps, precision, ratio, disk_path, ck = sys.argv[1:9]
cfg = config(int(rows), float(scale), int(batch), int(steps),
             {"kind": "disk", "cache_ratio": 0.01, "window": 8, "host_cache_ratio": float(ratio)}, disk_path)
cfg.model.embedding_dim = 16
cfg.optimizer.name = "adagrad"
cfg.precision.kind = precision
cfg.trainer.checkpoint_every = max(1, int(steps) // 2)  # two checkpoints: the second a delta on the first
saves = []
real_save = ckpt.save_checkpoint
before_saves = []
real_state_dict = Trainer.state_dict
def state_dict(self):
    if not before_saves:  # the high-water mark of training alone (VmHWM, kB), before the first save
        before_saves.append(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")))
    return real_state_dict(self)
Trainer.state_dict = state_dict
def timed_save(directory, step, state, keep=2):
    s0 = time.perf_counter()
    path = real_save(directory, step, state, keep)
    saves.append((time.perf_counter() - s0, sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())))
    return path
ckpt.save_checkpoint = timed_save
start = time.perf_counter()
t = Trainer(cfg)
build = time.perf_counter() - start
t.checkpoint_dir = Path(ck)
t.eval_loaders = {}  # throughput and checkpoints only
summary = t.fit()
print(json.dumps({"build s": build, "samples/s": summary["samples_per_second"],
                  "checkpoint s (1st, 2nd)": " / ".join(f"{s:.2f}" for s, _ in saves),
                  "checkpoint dir MiB after (1st, 2nd)": " / ".join(f"{b / 2**20:.1f}" for _, b in saves),
                  "peak RSS MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "peak RSS MiB before 1st checkpoint": before_saves[0] / 1024 if before_saves else None,
                  "disk GiB": summary["embedding_bytes"]["disk"] / 2**30,
                  "host MiB": summary["embedding_bytes"]["host"] / 2**20,
                  "cache": summary["cache"]}))
"""


_GENERATE = """
import sys
from bench.disk_bench import config
from recsys_cli.train.training_data import resolve_dataset
resolve_dataset(config(int(sys.argv[1]), float(sys.argv[2]), 1024, 1, {"kind": "disk"}).dataset)
"""


def benchmark_2(rows: int, scale: float, batch: int, steps: int, ratio: float, precisions: list[str]) -> list[dict]:
    # The synthetic data is generated (and cached) in a process of its own:
    # at x12 its generator holds GBs of per-id effects, which are not the
    # trainer's memory.
    subprocess.run([sys.executable, "-c", _GENERATE, str(rows), str(scale)], check=True)
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    out = []
    for precision in precisions:
        with tempfile.TemporaryDirectory(prefix="disk-bench-large-") as tmp:
            start = time.perf_counter()
            result = subprocess.run(
                [sys.executable, "-c", LARGE_CHILD, str(rows), str(scale), str(batch), str(steps), precision,
                 str(ratio), tmp, os.path.join(tmp, "ck")], capture_output=True, text=True)
            if result.returncode:
                raise SystemExit(result.stderr[-3000:])
            r = json.loads(result.stdout.strip().splitlines()[-1])
            cache = r.pop("cache")
            row = {"scale": scale, "precision": precision, "host cache ratio": ratio, "steps": steps, **r,
                   "disk MiB read/step": cache["disk_bytes_read_per_step"] / 2**20,
                   "disk reads/step": cache.get("disk_reads", 0) / steps,
                   "disk I/O ms/step (prefetch thread)": 1000 * cache.get("disk_io_seconds", 0) / steps,
                   "trainer waited ms/step": 1000 * cache["disk_wait_seconds_per_step"],
                   "wall s": time.perf_counter() - start, "load avg": os.getloadavg()[0],
                   "machine RAM GiB": memory_gib, "disk free GiB (after)": _free_gib(tmp)}
            print(row, flush=True)
            out.append(row)
    return out


def benchmark_io(rows: int, reads: int, rounds: int, threads: list[int]) -> list[dict]:
    import statistics

    import torch

    from recsys_cli.embeddings.disk_store import DiskRowStore
    from recsys_cli.embeddings.table_init import TableSpec

    with tempfile.TemporaryDirectory(prefix="disk-bench-io-") as tmp:
        store = DiskRowStore([TableSpec("t", rows, 16)], [0], "fp32", "stochastic", 0, 1, 0.0, tmp,
                             host_cache_rows=0, io_threads=max(threads))
        stride = rows // reads
        if stride * store.record_bytes < 2 * 4096:
            raise SystemExit(f"--io-rows {rows} / --io-reads {reads}: rows must be more than a page apart")
        os.fsync(store.fd)
        times = {(cache, n): [] for cache in ("dropped", "warm") for n in threads}
        for r in range(rounds):
            # the same rows each round, a different offset per round: no read hits an earlier round's pages
            ids = torch.arange(reads, dtype=torch.int64) * stride + (r * 7919) % stride
            for cache in ("dropped", "warm"):
                for n in threads:
                    if cache == "dropped":
                        os.posix_fadvise(store.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    store.set_io_threads(n)  # a pool sized to this count, not to the first one used
                    start = time.perf_counter()
                    store._read(ids)  # "warm": the pages the dropped reads just brought in
                    times[cache, n].append(time.perf_counter() - start)
                    print(f"round {r}, page cache {cache}: {n} threads {reads / times[cache, n][-1]:,.0f} rows/s",
                          flush=True)
        record_bytes = store.record_bytes
        store.close()
    out = []
    for (cache, n), t in times.items():
        base = statistics.median(times[cache, threads[0]])
        out.append({"page cache": cache, "rows": rows, "record bytes": record_bytes,
                    "file MiB": rows * record_bytes / 2**20, "reads per round": reads, "rounds": rounds,
                    "io threads": n, "rows/s (median)": reads / statistics.median(t),
                    "x one thread (median)": base / statistics.median(t),
                    "range": f"{reads / max(t):,.0f}-{reads / min(t):,.0f}", "load avg": os.getloadavg()[0]})
    return out


def _free_gib(path: str) -> float:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / 2**30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=20)
    parser.add_argument("--large", action="store_true", help="benchmark 2: tables larger than memory")
    parser.add_argument("--large-scale", type=float, default=12.0)
    parser.add_argument("--large-steps", type=int, default=2000)
    parser.add_argument("--large-host-cache-ratio", type=float, default=0.05)
    parser.add_argument("--large-precisions", default="fp32,int8")
    parser.add_argument("--io", action="store_true", help="benchmark 3: cold reads by I/O threads")
    parser.add_argument("--io-rows", type=int, default=8_000_000)
    parser.add_argument("--io-reads", type=int, default=4_000)
    parser.add_argument("--io-rounds", type=int, default=5)
    parser.add_argument("--io-threads", default="1,2,4,8,16")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if args.io:
        threads = [int(n) for n in args.io_threads.split(",")]
        rows = benchmark_io(args.io_rows, args.io_reads, args.io_rounds, threads)
        cmd = (f"python -m bench.disk_bench --io --io-rows {args.io_rows} --io-reads {args.io_reads} "
               f"--io-rounds {args.io_rounds} --io-threads {args.io_threads}")
        section = "Disk tier: cold reads by I/O threads (placement.disk_io_threads)"
        note = ("DiskRowStore reads of scattered rows (one pread each) from a file whose pages were dropped "
                "from the page cache before each read, alternating the thread counts within each round; then "
                "the same reads with the pages cached ('warm'). The cold ratio is what several requests in "
                "flight buy on this machine's disk; the warm one must stay near 1.")
    elif args.large:
        rows = benchmark_2(args.rows, args.large_scale, args.batch, args.large_steps, args.large_host_cache_ratio,
                           args.large_precisions.split(","))
        cmd = (f"python -m bench.disk_bench --large --rows {args.rows} --large-scale {args.large_scale} "
               f"--large-steps {args.large_steps} --batch {args.batch} "
               f"--large-host-cache-ratio {args.large_host_cache_ratio} --large-precisions {args.large_precisions}")
        section = "Disk tier: tables beyond memory (disk placement, dim 16, Adagrad)"
        note = ("Goal (issue 17): Kaggle cardinalities x12 (about 26 GB) completes under a 4 GB host budget at "
                ">= 0.5x benchmark 1's host run. Peak RSS per process. Machine memory and disk: see the rows.")
    else:
        rows = benchmark_1(args.rows, args.scale, args.batch, args.steps, args.chunk)
        cmd = (f"python -m bench.disk_bench --rows {args.rows} --scale {args.scale} --steps {args.steps} "
               f"--batch {args.batch} --chunk {args.chunk}")
        section = "Disk tier: disk (5 % host cache) vs host placement (dlrm_kaggle)"
        note = ("Goal (issue 17): disk >= 0.7x host with a window that covers the I/O. One process, the two "
                "trainers alternating in chunks; the disk trainer's prefetch thread may run up to its window "
                "ahead while the host trainer's chunk runs.")
    if args.record:
        from bench.record import record

        record(section, list(rows[0]), rows, cmd, note=note)


if __name__ == "__main__":
    main()
