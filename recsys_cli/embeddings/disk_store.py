"""DiskRowStore: a group's rows and optimizer state in a file on local disk,
behind a bounded host cache of rows.

The store implements RowStore's protocol (store.py: read/write/encode,
read_rows/read_state, table_snapshot/load_table,
memory/stats), so a CachedGroup (cache.py) sits in front of it exactly as in
front of a host store: `placement=disk` is the lookahead cache over this
store, and every invariant of the cache (one owner per row, residency from
the batches alone, exact resume) holds unchanged. Values are stored bit for
bit as a RowStore stores them (the same encode, keyed by the same rounding
keys), so a disk group trains to exactly the bits of the same group in host
memory, in every precision.

File layout: one file of fixed-size records, row r at offset r * R. A record
is the row's native fields (quant.py: fp32 or fp16 weights; int8/int4 codes
then fp16 scale and bias) followed by its fp32 optimizer state, so one read
brings a row and its state.

I/O path (docs/how-to/disk-tables.md): explicit os.preadv / os.pwritev on that
file, with this store's own host cache of rows, not mmap. Why: the host
memory a run uses must be bounded by configuration (placement.host_cache_rows
/ host_cache_ratio), and with mmap the resident pages are the kernel's
choice (they count in the process's RSS, and madvise is only advice); with
explicit reads the store decides what stays, reads a batch's misses sorted
and coalesced (neighbouring rows within one page come in one read), and
writes dirty rows back in batches, sorted, in runs of consecutive rows. A
page-cache miss in mmap also stalls whichever thread touches the page,
where a pread stalls only the prefetch thread that issued it.

The host cache is a write-back victim cache of the device cache: rows the
cache writes back (evicts) are admitted, dirty, and reach the file when the
host cache evicts them (least recently used first, in chunks of
host_cache_rows / 32, so write-backs come in sorted batches); a read that
misses goes to the file and is not admitted (the row moves into the device
cache, which owns it until it comes back here). Its index is a SlotIndex
sized to the host cache, never to the table. Within the store a row has one
current value: its host slot when it has one, else the file.

Thread safety: the lookahead prefetcher reads and writes back on its own
thread while the trainer reads and updates rows the device cache does not
hold (low precision) and reads for evaluation: one lock serialises the
store. Which rows sit in the host cache then depends on thread timing, but
never a value: each row's reads and writes are ordered by the cache in front.

Building: the file is filled chunk by chunk by table_init.build_initial_rows (the
counter-based initialisation of table_init.py, the same values in any chunking,
placement or precision), encoded with the initial rounding keys RowStore
uses: memory for one chunk, whatever the table's size.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import numpy as np
import torch

from recsys_cli.embeddings.disk_records import RecordCodec
from recsys_cli.embeddings.quant import INIT_STEP
from recsys_cli.embeddings.slot_index import SlotIndex
from recsys_cli.embeddings.store import RowStore
from recsys_cli.embeddings.table_init import TableSpec, build_initial_rows
from recsys_cli.errors import UserError

if TYPE_CHECKING:
    from recsys_cli.embeddings.protocols import RowStoreProtocol

DIR_PREFIX = "recsys-disk-"  # a live store's own directory under placement.disk_path
OWNER = "owner.pid"
PAGE_BYTES = 4096  # rows closer than a page apart are read in one run (read amplification < 2 per gap)
# Values encoded and written per piece of the build (build_initial_rows): one
# init block at dim 128. A piece's ~100 small torch/numpy calls hold the GIL
# between ops, so the build threads overlap less the smaller the piece: 1 << 16
# built 46-50M values/s on both cores (1.4 cores busy), 1 << 19 95-115M (1.8
# cores), same bytes (2-core Intel Xeon, idle, 2026-12-05, BENCHMARKS.md).
BUILD_ELEMENTS = 1 << 19
COPY_BYTES = 16 << 20  # bytes per chunk when copying or loading whole tables
# Disk reads in flight (_pread_runs): a read whose first PROBE_RUNS runs took
# SLOW_READ_SECONDS or more each came from the disk, not the page cache (a
# few microseconds), and the rest go to the I/O threads, PARALLEL_RUNS at
# least per thread.
PROBE_RUNS = 8
SLOW_READ_SECONDS = 50e-6
PARALLEL_RUNS = 16


# What a damaged live table means for the run: nothing after the last checkpoint is kept.
LOST = ("rows trained since the last checkpoint are lost, so the run stops; the last checkpoint is kept: resume "
        "from it (trainer.resume=true), with placement.disk_path on a disk nothing else writes to")


def disk_error(path, e: OSError, doing: str) -> UserError:
    """One line naming the path and what failed (full disk, unwritable path)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return UserError(f"{path}: no space left while {doing} ({e.strerror}); free disk space or set "
                         "placement.disk_path to a larger disk")
    return UserError(f"{path}: cannot {doing}: {e.strerror or e}; set placement.disk_path to a writable directory")


class DiskRowStore:
    """Rows of fused tables in a record file under `directory`, behind a host
    cache of `host_cache_rows` records."""

    # Rounding keys exactly as a RowStore makes them (seed, table, row within
    # the table, step), from the same attributes: one implementation.
    key = RowStore.key
    encode = RowStore.encode

    def __init__(self, tables: list[TableSpec], table_numbers: list[int], precision: str, rounding: str, seed: int,
                 state_width: int, initial_state: float, directory: str | None, host_cache_rows: int,
                 io_threads: int = 1) -> None:
        self._io_pool: ThreadPoolExecutor | None = None  # made at the first read that uses it
        self.set_io_threads(io_threads)
        self.tables = tables
        self.dim = tables[0].dim
        self.num_rows = sum(t.num_rows for t in tables)
        self.seed = seed
        self.device = torch.device("cpu")
        self.initial_state = initial_state
        sizes = torch.tensor([t.num_rows for t in tables], dtype=torch.int64)
        self._table_start = torch.cumsum(sizes, 0) - sizes
        self._table_number = torch.tensor(table_numbers, dtype=torch.int64)
        self._table_base = self._table_start - torch.tensor([t.first_row for t in tables])  # RowStore.key: a shard's rows keyed as its table's
        self.codec = RecordCodec(self.dim, precision, rounding, state_width)
        self.rows = self.codec.rows  # RowStore.encode encodes through self.rows
        self.record_bytes = R = self.codec.record_bytes
        self.lock = threading.RLock()
        self.stats_ = dict(disk_bytes_read=0, disk_bytes_written=0, disk_bytes_needed=0, disk_reads=0,
                           disk_writes=0, host_cache_hits=0, host_cache_misses=0, disk_io_seconds=0.0,
                           disk_wait_seconds=0.0)
        # The host cache: records in slots, a row -> slot index sized to it, LRU clock per slot.
        self.host_capacity = max(0, min(int(host_cache_rows), self.num_rows))
        H = self.host_capacity
        self.host = torch.empty(H, R, dtype=torch.uint8)
        self.index = SlotIndex(max(H, 1), max_key=self.num_rows - 1)
        self.host_row = torch.full((H,), -1, dtype=torch.int64)
        self.host_dirty = torch.zeros(H, dtype=torch.bool)
        self.host_score = torch.zeros(H, dtype=torch.int64)
        self.free = list(range(H - 1, -1, -1))
        self.clock = 0
        self.evict_chunk = max(1, H // 32)
        # Checkpoints (disk_checkpoint.py, through the methods at the end):
        # per table, the files of the last committed checkpoint's chain, the
        # rows changed since it, and the rows a save took that its checkpoint
        # has not committed yet (a failed save leaves them for the next).
        self._chain: list[dict | None] = [None] * len(tables)
        self._changed: list[list[torch.Tensor]] = [[] for _ in tables]
        self._taken: list[torch.Tensor | None] = [None] * len(tables)
        self._open(directory)
        self._build()
        # Per table: the file still holds the rows the build wrote (a resume
        # from a chain whose base is the initial rows replays its deltas only).
        self._as_built = [True] * len(tables)

    # --- the file ------------------------------------------------------------
    def _open(self, directory: str | None) -> None:
        parent = directory or tempfile.gettempdir()
        need = self.num_rows * self.record_bytes
        try:
            os.makedirs(parent, exist_ok=True)
            _remove_orphans(parent)
            self.directory = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=parent)
            with open(os.path.join(self.directory, OWNER), "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            raise disk_error(parent, e, "create the disk tables' directory") from None
        self.path = os.path.join(self.directory, "rows.bin")
        self._finalizer = weakref.finalize(self, _remove, self.directory)
        free = shutil.disk_usage(self.directory).free
        if need > free:
            self.close()
            raise UserError(f"{parent}: the disk tables need {need:,} bytes but the disk has {free:,} free; "
                            "free disk space or set placement.disk_path to a larger disk")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _close_and_remove, self.fd, self.directory)
            if need:
                os.posix_fallocate(self.fd, 0, need)  # the space now, not a full disk halfway through training
            opened = os.fstat(self.fd)
            self._inode, self._device = opened.st_ino, opened.st_dev
        except OSError as e:
            self.close()
            raise disk_error(self.path, e, f"allocate {need:,} bytes of disk tables") from None

    def close(self) -> None:
        """Close and delete the store's file (its directory is the store's own)."""
        self.set_io_threads(self.io_threads)  # stops the pool
        self._finalizer()

    def set_io_threads(self, io_threads: int) -> None:
        """Reads in flight from now on: the pool of the old count stops, and the
        next read that needs threads starts one of `io_threads`."""
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if self._io_pool is not None:
            self._io_pool.shutdown()
            self._io_pool = None
        self.io_threads = io_threads

    def _build(self) -> None:
        """Every table's initial rows, chunk by chunk, straight into the file:
        table_init's builder, chunks of BUILD_ELEMENTS values (temporaries
        that stay in cache) on every core at once, each chunk's ops on one
        thread (a disk table of MLPerf's size built one chunk at a time with
        an OpenMP team per op took 20+ minutes on a loaded 2-core box). The
        bytes do not depend on the chunking or the workers (table_init)."""
        build_initial_rows(self.tables, self.seed, self._write_initial, chunk_rows=max(1, BUILD_ELEMENTS // self.dim),
                           workers=torch.get_num_threads())

    def _write_initial(self, start: int, rows: torch.Tensor) -> None:
        """Fused rows [start, start + n): encoded (rounding keyed by INIT_STEP),
        with their initial optimizer state, written to the file (build workers
        write disjoint rows at once: pwritev at their own offsets)."""
        ids = torch.arange(start, start + rows.shape[0])
        encoded = self.rows.encode(rows, self.key(ids, INIT_STEP))
        state = torch.full((rows.shape[0], self.codec.state_width), self.initial_state, dtype=torch.float32)
        self._pwrite_range(start, self.codec.pack(encoded, state))

    def _pwrite_range(self, first: int, records: torch.Tensor) -> None:
        buf = records.numpy()
        try:
            written = os.pwritev(self.fd, [memoryview(buf).cast("B")], first * self.record_bytes)
        except OSError as e:
            raise disk_error(self.path, e, "write disk table rows") from None
        if written != buf.nbytes:
            raise UserError(f"{self.path}: short write ({written} of {buf.nbytes} bytes): is the disk full?")

    def _pread_range(self, first: int, out: np.ndarray) -> None:
        view = memoryview(out).cast("B")
        done, offset = 0, first * self.record_bytes
        while done < view.nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:  # the file ends early: something truncated it behind the store
                raise UserError(f"{self.path}: short read ({done:,} of {view.nbytes:,} bytes at byte {offset:,}): "
                                f"the live disk table was truncated behind the run; {LOST}")
            done += got

    def _check_file(self) -> None:
        """The live file is still the store's own and whole (at every batch of
        reads or writes: an fstat and a stat, microseconds). A file truncated
        or replaced behind the store would serve zeros or another file's rows
        (a write past a truncated end even succeeds), so the run stops."""
        need = self.num_rows * self.record_bytes
        size = os.fstat(self.fd).st_size
        if size < need:
            raise UserError(f"{self.path}: the live disk table was truncated to {size:,} of {need:,} bytes "
                            f"behind the run; {LOST}")
        try:
            now = os.stat(self.path)
        except OSError:
            now = None
        if now is None or (now.st_ino, now.st_dev) != (self._inode, self._device):
            raise UserError(f"{self.path}: the live disk table was {'deleted' if now is None else 'replaced'} "
                            f"behind the run; {LOST}")

    def _read_file(self, rows: torch.Tensor) -> torch.Tensor:
        """Records of sorted distinct `rows` from the file: runs of rows less
        than a page apart come in one read (the gap is read and dropped)."""
        n, R = rows.numel(), self.record_bytes
        out = torch.empty(n, R, dtype=torch.uint8)
        if n == 0:
            return out
        self._check_file()
        start = time.perf_counter()
        r = rows.numpy()
        gap = max(0, PAGE_BYTES // R - 1)
        breaks = np.flatnonzero(np.diff(r) > gap + 1) + 1
        first_at = np.concatenate([[0], breaks])
        last_at = np.concatenate([breaks - 1, [n - 1]])
        starts, ends = r[first_at], r[last_at] + 1
        spans = ends - starts
        buf = np.empty((int(spans.sum()), R), dtype=np.uint8)
        base = np.cumsum(spans) - spans
        self._pread_runs(starts, spans, base, buf)
        run = np.repeat(np.arange(len(starts)), last_at - first_at + 1)
        out.numpy()[:] = buf[base[run] + r - starts[run]]
        self.stats_["disk_bytes_read"] += buf.nbytes
        self.stats_["disk_bytes_needed"] += n * R
        self.stats_["disk_reads"] += len(starts)
        self.stats_["disk_io_seconds"] += time.perf_counter() - start
        return out

    def _pread_runs(self, starts: np.ndarray, spans: np.ndarray, base: np.ndarray, buf: np.ndarray) -> None:
        """Run i (spans[i] records from row starts[i]) into buf[base[i]:].

        Reads that come from the disk are shared out among io_threads threads,
        each a contiguous share of the sorted runs: a disk serves several
        requests in flight faster than one at a time (an SSD many times
        faster; this machine's virtual disk about 3x with 8), and os.preadv
        releases the GIL. Reads the page cache serves take microseconds, and threads
        would cost more than they save (8 threads made 128 such reads 7x
        slower on two busy cores), so the first PROBE_RUNS runs are read here
        and timed, and only reads slower than SLOW_READ_SECONDS each send the
        rest to the threads. The runs fill disjoint parts of buf: the bytes
        do not depend on who read them."""
        def read(lo: int, hi: int) -> None:
            for s, k, b in zip(starts[lo:hi].tolist(), spans[lo:hi].tolist(), base[lo:hi].tolist()):
                self._pread_range(s, buf[b:b + k])

        n = len(starts)
        probe = min(n, PROBE_RUNS)
        began = time.perf_counter()
        read(0, probe)
        workers = min(self.io_threads, (n - probe) // PARALLEL_RUNS)
        if workers <= 1 or (time.perf_counter() - began) / max(probe, 1) < SLOW_READ_SECONDS:
            return read(probe, n)
        if self._io_pool is None:
            self._io_pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="recsys-disk-io")
        bounds = np.linspace(probe, n, workers + 1).astype(np.int64).tolist()
        reads = [self._io_pool.submit(read, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
        wait(reads)  # every read ends before buf is used or dropped
        for r in reads:
            r.result()  # a worker's error, raised here

    def _write_file(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """Records of distinct `rows` into the file, sorted, one write per run of consecutive rows."""
        if rows.numel() == 0:
            return
        self._check_file()
        start = time.perf_counter()
        order = torch.argsort(rows)
        r, rec = rows[order].numpy(), records[order].numpy()
        breaks = np.flatnonzero(np.diff(r) != 1) + 1
        bounds = np.concatenate([[0], breaks, [len(r)]]).tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            self._pwrite_range(int(r[a]), torch.from_numpy(rec[a:b]))
        self.stats_["disk_bytes_written"] += rec.nbytes
        self.stats_["disk_writes"] += len(bounds) - 1
        self.stats_["disk_io_seconds"] += time.perf_counter() - start

    # --- the host cache ----------------------------------------------------------
    def _records(self, ids: torch.Tensor) -> torch.Tensor:
        """Current records of `ids` (any order, repeats allowed), lock held; no admission."""
        unique, inverse = torch.unique(ids.to(torch.int64), sorted=True, return_inverse=True)
        out = torch.empty(unique.numel(), self.record_bytes, dtype=torch.uint8)
        slots = self.index.lookup(unique) if self.host_capacity else torch.full_like(unique, -1)
        hit_at = torch.nonzero(slots >= 0).flatten()
        miss_at = torch.nonzero(slots < 0).flatten()
        if hit_at.numel():
            out[hit_at] = self.host[slots[hit_at]]
        if miss_at.numel():
            out[miss_at] = self._read_file(unique[miss_at])
        return out, inverse, slots[hit_at], hit_at.numel(), miss_at.numel()

    def _read(self, ids: torch.Tensor) -> torch.Tensor:
        with self._locked():
            out, inverse, hit_slots, hits, misses = self._records(ids)
            if hits:
                self.clock += 1
                self.host_score[hit_slots] = self.clock
            self.stats_["host_cache_hits"] += hits
            self.stats_["host_cache_misses"] += misses
            return out[inverse]

    def _write(self, ids: torch.Tensor, records: torch.Tensor) -> None:
        """Store records of distinct `ids`: into the host cache (dirty), the
        file for what the cache has no room for."""
        ids = ids.to(torch.int64)
        with self._locked():
            self._note_changed(ids)
            if self.host_capacity == 0:
                self._write_file(ids, records)
                return
            self.clock += 1
            slots = self.index.lookup(ids)
            present = torch.nonzero(slots >= 0).flatten()
            if present.numel():
                self.host[slots[present]] = records[present]
                self.host_dirty[slots[present]] = True
                self.host_score[slots[present]] = self.clock
            new = torch.nonzero(slots < 0).flatten()
            if new.numel() == 0:
                return
            resident = self.host_capacity - len(self.free)
            room = len(self.free) + resident - present.numel()  # slots not holding this write's rows
            admit, direct = new[:room], new[room:]
            self._write_file(ids[direct], records[direct])
            if admit.numel() > len(self.free):
                self._evict(max(admit.numel() - len(self.free), self.evict_chunk))
            got = torch.tensor([self.free.pop() for _ in range(admit.numel())], dtype=torch.int64)
            self.index.insert(ids[admit], got)
            self.host_row[got] = ids[admit]
            self.host[got] = records[admit]
            self.host_dirty[got] = True
            self.host_score[got] = self.clock

    def _evict(self, count: int) -> None:
        """Free `count` host slots (or all that may go), least recently used
        first, ties by slot; dirty ones are written back in one sorted batch.
        Slots used by the current write (score == clock) stay."""
        evictable = (self.host_row >= 0) & (self.host_score < self.clock)
        count = min(count, int(evictable.sum()))
        if count == 0:
            return
        H = self.host_capacity
        key = torch.where(evictable, self.host_score * H + torch.arange(H), torch.iinfo(torch.int64).max)
        victims = torch.sort(torch.topk(key, count, largest=False, sorted=False).indices).values
        dirty = victims[self.host_dirty[victims]]
        self._write_file(self.host_row[dirty], self.host[dirty])
        self.index.remove(self.host_row[victims])
        self.host_row[victims] = -1
        self.host_dirty[victims] = False
        self.free.extend(victims.flip(0).tolist())

    def _drop(self, lo: int, hi: int) -> None:
        """Forget host-cached rows of [lo, hi) without writing them (the file was overwritten)."""
        slots = torch.nonzero((self.host_row >= lo) & (self.host_row < hi)).flatten()
        if slots.numel():
            self.index.remove(self.host_row[slots])
            self.host_row[slots] = -1
            self.host_dirty[slots] = False
            self.free.extend(slots.flip(0).tolist())

    def flush(self) -> None:
        """Write every dirty host-cached row to the file (benchmarks; never needed for correctness)."""
        with self._locked():
            dirty = torch.nonzero(self.host_dirty).flatten()
            self._write_file(self.host_row[dirty], self.host[dirty])
            self.host_dirty[dirty] = False

    def _locked(self):
        return _TimedLock(self)

    def _note_changed(self, ids: torch.Tensor) -> None:
        """Remember which rows changed since the last checkpoint (per table, local ids)."""
        if len(self.tables) == 1:
            table = torch.zeros_like(ids)
        else:
            table = torch.searchsorted(self._table_start, ids, right=True) - 1
        for t in torch.unique(table).tolist():
            self._as_built[t] = False
            local = ids[table == t] - self._table_start[t]
            lst = self._changed[t]
            lst.append(local)
            if len(lst) > 64:  # bound the list: merge (memory grows with distinct changed rows only)
                self._changed[t] = [torch.unique(torch.cat(lst))]

    # --- RowStore's protocol -----------------------------------------------------
    @property
    def precision(self) -> str:
        return self.codec.precision

    @property
    def state_width(self) -> int:
        return self.codec.state_width

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        encoded, state = self.codec.unpack(self._read(ids))
        return self.codec.decode(encoded), state

    def read_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.read(ids)[0]

    def read_state(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codec.unpack(self._read(ids))[1]

    def write(self, ids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, step: int | None = None) -> None:
        keyed = self.precision != "fp32" and self.codec.rounding == "stochastic"
        if keyed and step is None:
            raise ValueError("a stochastically rounded write needs its step (the rounding key)")
        ids = ids.cpu()
        encoded = self.rows.encode(rows.cpu(), self.key(ids, step) if keyed else None)
        if state.shape[1] != self.state_width:  # SGD writes an empty state
            state = torch.full((ids.numel(), self.state_width), self.initial_state)
        self._write(ids, self.codec.pack(encoded, state.cpu()))

    def nbytes(self) -> int:
        """Host bytes: the host cache and its index (the rows themselves are on disk)."""
        return sum(b for tier, _, b in self.memory("disk") if tier == "host")

    def memory(self, tier: str) -> list[tuple[str, str, int]]:
        cache = self.host.numel() + sum(t.numel() * t.element_size()
                                        for t in (self.host_row, self.host_dirty, self.host_score))
        return [("disk", "table", self.num_rows * self.record_bytes), ("host", "cache", cache),
                ("host", "index", self.index.nbytes())]

    def stats(self) -> dict:
        s = dict(self.stats_)
        s["host_cache_rows"] = self.host_capacity
        return s

    # --- checkpoints (disk_checkpoint.py) -----------------------------------------
    # What a checkpoint of this store may call; the store's state changes only here.
    def table_snapshot(self, spec: TableSpec, lo: int, hi: int, patch=None):
        from recsys_cli.embeddings.disk_checkpoint import DiskTableSnapshot

        return DiskTableSnapshot(self, self.tables.index(spec), patch)

    def load_table(self, spec: TableSpec, lo: int, hi: int, saved) -> None:
        from recsys_cli.embeddings.disk_checkpoint import load_disk_table

        load_disk_table(self, self.tables.index(spec), saved)

    def exclusive(self):
        """Hold the store alone (start-up, or a checkpoint writing a table):
        no other thread reads or writes it until the block ends, whatever
        the prefetcher does. Untimed: not a wait of the trainer's step."""
        return self.lock

    def table_first_row(self, table: int) -> int:
        """The fused row id of table `table`'s row 0."""
        return int(self._table_start[table])

    def table_identity(self, table: int) -> dict:
        """What a checkpoint's records of table `table` depend on: the record
        layout and the initial rows' keys. A checkpoint whose identity is the
        store's replays into the file as it is."""
        return {"rows": self.tables[table].num_rows, "dim": self.tables[table].dim, "precision": self.precision,
                "rounding": self.codec.rounding, "state_width": self.state_width, "record_bytes": self.record_bytes,
                "seed": self.seed, "table_number": int(self._table_number[table]),
                **({"first_row": spec.first_row, "table_rows": spec.whole_rows} if (spec := self.tables[table]).first_row
                   or spec.table_num_rows is not None else {})}  # a shard: its rows start from the table's

    def chain(self, table: int) -> dict | None:
        """The files of table `table`'s last committed checkpoint (None: its base is the initial rows)."""
        return self._chain[table]

    def take_changed(self, table: int) -> torch.Tensor:
        """Sorted local ids of the rows of `table` changed since its last
        committed checkpoint, for a save to write. They stay owed to the next
        save until commit_checkpoint; rows changed from now on are noted for
        the next save whatever happens to this one (so a write while the save
        runs is never lost, with or without the prefetcher paused)."""
        with self.lock:
            parts = self._changed[table]
            if self._taken[table] is not None:
                parts = [self._taken[table], *parts]
            self._changed[table] = []
            self._taken[table] = torch.unique(torch.cat(parts)) if parts else torch.zeros(0, dtype=torch.int64)
            return self._taken[table]

    def commit_checkpoint(self, table: int, chain: dict, still_changed: torch.Tensor | None) -> None:
        """The checkpoint holding `chain` is in place: the next save of `table`
        continues from it, with the rows changed since take_changed plus
        `still_changed` (rows the checkpoint took from elsewhere, a cache,
        that the store's file does not hold yet)."""
        with self.lock:
            self._chain[table] = chain
            self._taken[table] = None
            if still_changed is not None and still_changed.numel():
                self._changed[table].insert(0, still_changed)

    def read_records(self, table: int, local: torch.Tensor) -> torch.Tensor:
        """Current records (uint8 [n, R]) of local rows `local` of `table`, in
        their order; the host cache's use is left as it is (no admission)."""
        with self.lock:
            records, inverse, *_ = self._records(local + self._table_start[table])
            return records[inverse]

    def holds_initial_rows(self, table: int) -> bool:
        """Whether `table` holds the rows its build wrote: no write and no
        replace since."""
        return self._as_built[table]

    def replace_table(self, table: int, chunks, chain: dict | None) -> None:
        """Overwrite rows of `table` with the (local ids, records) chunks
        (later chunks win; rows no chunk names keep what the file holds),
        forgetting its host-cached rows; its next save continues from `chain`
        (None: writes a new base) with no rows changed."""
        lo = int(self._table_start[table])
        with self.lock:
            self._drop(lo, lo + self.tables[table].num_rows)
            for local, records in chunks:
                self._write_file(local + lo, records)
            self._as_built[table] = False
            self._chain[table] = chain
            self._changed[table], self._taken[table] = [], None


class _TimedLock:
    """The store's lock for reads and writes; the time the trainer's (main)
    thread spends in them, waiting for the lock or for its own I/O, is
    disk_wait_seconds (checkpoints and loads take the lock untimed)."""

    __slots__ = ("store", "start")

    def __init__(self, store: DiskRowStore) -> None:
        self.store = store

    def __enter__(self):
        self.start = time.perf_counter()
        self.store.lock.acquire()
        return self

    def __exit__(self, *exc):
        if threading.current_thread() is threading.main_thread():
            self.store.stats_["disk_wait_seconds"] += time.perf_counter() - self.start
        self.store.lock.release()


def _remove_orphans(parent: str) -> None:
    """Delete live-table directories whose process is gone (killed runs
    cannot clean up after themselves); only directories this tool made, the
    pid their OWNER file names (data_tools/stale.py)."""
    from pathlib import Path

    from data_tools.stale import remove_dead

    def owner(path: Path) -> int:
        return int((path / OWNER).read_text().strip())

    remove_dead(parent, re.escape(DIR_PREFIX) + ".*", pid_of=owner)


def _remove(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def _close_and_remove(fd: int, directory: str) -> None:
    try:
        os.close(fd)
    finally:
        _remove(directory)


if TYPE_CHECKING:  # mypy: a DiskRowStore is what protocols.RowStoreProtocol promises, as a RowStore is

    def _is_a_row_store(store: DiskRowStore) -> RowStoreProtocol:
        return store
