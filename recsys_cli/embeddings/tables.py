"""Table groups: the tables of one placement behind one fused row store.

A group owns a set of tables, fused into one row space with per-table row
offsets. The collection asks each group for the rows of a batch's plan
(`gather`) and hands back their gradients (`update`); where the rows live,
and how they get to the device, is the group's business:

  DirectGroup   rows read from the store and written back every step; the
                store lives on the device ("device") or in host memory ("host").
  CachedGroup   (cache.py) a device cache of fp32 rows in front of the store,
                filled ahead by the lookahead prefetcher or on demand.
"""

from __future__ import annotations

import abc
import concurrent.futures
import math
import threading
import zlib
from dataclasses import dataclass

import torch

from recsys_cli.device import PinnedStaging, runtime_for
from recsys_cli.embeddings.counter import MASK32 as _MASK32
from recsys_cli.embeddings.counter import fmix32 as _fmix32
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.plan import LookupPlan
from recsys_cli.embeddings.store import RowStore


@dataclass(frozen=True)
class TableSpec:
    name: str
    num_rows: int
    dim: int


# Initialisation keyed by block. A row's initial values are a function of
# (seed, table name, row) only: each block of INIT_BLOCK_ROWS rows of a table
# is drawn from its own generator, seeded by a hash of (seed, table, block),
# so a table built in one piece, in chunks of any size, on another device, in
# another placement or precision, or by another process starts from the same
# fp32 values. The block is the unit of the key, not of the build: rows
# [a, b) draw the prefix of their blocks' streams they need. torch's CPU
# Mersenne twister draws one 32-bit word per value, serially, so a prefix of a
# stream is the same however long the draw; a value is a uniform 24-bit
# integer times one fp32 scale, exact (and CUDA tables copy the CPU draw).
# About 15x faster than hashing every element (45 int64 ops per value), which
# is what start-up spent its seconds on. The generator's seed is 32 bits, so
# two of the ~2**13 blocks of a Kaggle-sized model share a stream with odds
# of about 1 in 100: harmless for an initialisation.
INIT_BLOCK_ROWS = 4096
_SERIAL_ELEMENTS = 1 << 15  # at most torch's grain size (32768): such an op runs on the calling thread


def table_key(name: str, seed: int) -> tuple[int, int]:
    """Two 32-bit keys of a table's initial values, from the run seed and the
    table's name (not its position among the features)."""
    name_hash = zlib.crc32(name.encode())
    k1 = _fmix32((_fmix32(seed & _MASK32) ^ name_hash) & _MASK32)
    k2 = _fmix32(k1 ^ (seed >> 32 & _MASK32) ^ 0x9E3779B9)
    return k1, k2


def _block_seed(keys: tuple[int, int], block: int) -> int:
    k1, k2 = keys
    return _fmix32(_fmix32((block & _MASK32) ^ k1) ^ (block >> 32 & _MASK32) ^ k2)


def init_into(out: torch.Tensor, spec: TableSpec, row_start: int, seed: int) -> torch.Tensor:
    """Fill `out` (fp32 [n, dim] on the CPU, rows contiguous) with the initial
    rows [row_start, row_start + n) of table `spec`, in place; returns `out`.
    The values: uniform in [-b, b) with b = sqrt(1 / num_rows), DLRM's (and
    TorchRec's) table init."""
    n = out.shape[0]
    row_end = row_start + n
    if not 0 <= row_start <= row_end <= spec.num_rows:
        raise ValueError(f"rows [{row_start}, {row_end}) outside table {spec.name} of {spec.num_rows} rows")
    if out.shape[1:] != (spec.dim,) or out.dtype != torch.float32 or out.device.type != "cpu":
        raise ValueError(f"init_into needs a CPU fp32 [n, {spec.dim}] tensor, got {out.dtype} {tuple(out.shape)}")
    keys = table_key(spec.name, seed)
    bound = torch.tensor(1.0 / math.sqrt(spec.num_rows), dtype=torch.float32).item()
    scale = bound / (1 << 23)  # codes in [-2**23, 2**23): values exact in fp32, strictly inside the bound
    codes = torch.empty(min(n, INIT_BLOCK_ROWS) * spec.dim, dtype=torch.int32)
    gen = torch.Generator()
    piece = max(1, _SERIAL_ELEMENTS // spec.dim)
    row = row_start
    while row < row_end:
        block = row // INIT_BLOCK_ROWS
        first = block * INIT_BLOCK_ROWS
        last = min(row_end, first + INIT_BLOCK_ROWS)
        gen.manual_seed(_block_seed(keys, block))
        skip = (row - first) * spec.dim  # the block's stream from its first row: draw the prefix, keep the end
        if codes.numel() < (last - first) * spec.dim:
            codes = torch.empty((last - first) * spec.dim, dtype=torch.int32)
        drawn = codes[: (last - first) * spec.dim].random_(-(1 << 23), 1 << 23, generator=gen)
        codes_rows = drawn[skip:].view(last - row, spec.dim)
        for p in range(0, last - row, piece):  # pieces under torch's grain size: no OpenMP team per op
            dest = out[row - row_start + p : min(last, row + p + piece) - row_start]
            dest.copy_(codes_rows[p : p + dest.shape[0]])  # int32 -> fp32, exact (|code| <= 2**23)
            dest.mul_(scale)  # (torch.mul(int32, s, out=fp32) takes a 25x slower casting loop)
        row = last
    return out


def init_rows(spec: TableSpec, row_start: int, row_end: int, seed: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Initial fp32 rows [row_start, row_end) of table `spec` (init_into).
    Any split of a table into row ranges concatenates to the same tensor, on
    any device."""
    if not 0 <= row_start <= row_end <= spec.num_rows:
        raise ValueError(f"rows [{row_start}, {row_end}) outside table {spec.name} of {spec.num_rows} rows")
    out = init_into(torch.empty(row_end - row_start, spec.dim), spec, row_start, seed)
    return out.to(device)


def init_table(spec: TableSpec, seed: int) -> torch.Tensor:
    """The whole table's initial rows."""
    return init_rows(spec, 0, spec.num_rows, seed)


# Rows built at a time: one chunk of fp32 values (4 MiB) and the quantizer's
# temporaries are all a build holds beyond the table itself.
CHUNK_ELEMENTS = 1 << 20


def build_initial_rows(specs: list[TableSpec], seed: int, write, chunk_rows: int | None = None, into=None,
                       workers: int = 1) -> None:
    """Build tables `specs`, fused in order, chunk by chunk, straight into
    their destination: the initial fp32 rows of fused rows [start, start + n)
    go to write(start, rows) (rows: a CPU fp32 [n, dim] buffer reused for the
    next chunk: copy or encode it before returning). into(start, end), if
    given, may instead return a CPU fp32 view of the destination to fill in
    place (an fp32 host table), or None. The values do not depend on
    chunk_rows (default CHUNK_ELEMENTS // dim) nor on `workers`; a chunk never
    spans two tables. A store in any precision and location
    (RowStore.write_initial), or a file on disk, is built this way.

    workers > 1 builds chunks on that many threads at once (write and into
    are then called concurrently, for disjoint rows). Every torch op of the
    build runs on one intra-op thread: the ops are small and many, and an
    OpenMP team per op on a loaded machine spins and waits for its slowest
    member (measured: 26x the CPU time of one thread with two of them)."""
    if not specs:
        return
    dim = specs[0].dim
    chunk_rows = chunk_rows or max(1, CHUNK_ELEMENTS // dim)
    chunks = []
    start = 0
    for spec in specs:
        chunks += [(spec, start, lo, min(spec.num_rows, lo + chunk_rows)) for lo in range(0, spec.num_rows, chunk_rows)]
        start += spec.num_rows
    local = threading.local()

    def build(chunk) -> None:
        spec, start, lo, hi = chunk
        view = into(start + lo, start + hi) if into is not None else None
        if view is not None:
            init_into(view, spec, lo, seed)
            return
        if getattr(local, "buffer", None) is None:
            local.buffer = torch.empty(chunk_rows, dim)
        write(start + lo, init_into(local.buffer[: hi - lo], spec, lo, seed))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if workers <= 1 or len(chunks) == 1:
            for chunk in chunks:
                build(chunk)
        else:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                for done in pool.map(build, chunks):  # re-raises a chunk's error
                    del done
    finally:
        torch.set_num_threads(threads)


class TableGroup(abc.ABC):
    """The tables of one placement behind one store (see the module docstring).
    The collection talks to a group only through these methods."""

    kind: str = "base"  # the placement's name: device, uvm, cache, lookahead
    lookahead: bool = False  # True: the prefetcher prepares its plans ahead, on its thread

    def __init__(
        self, tables: list[TableSpec], feature_tables: list[str], store: RowStore,
        optimizer: RowOptimizer, device: torch.device, store_tier: str = "device",
    ) -> None:
        self.tables = tables
        self.store_tier = store_tier  # where the store counts: "device" or "host"
        self.optimizer = optimizer
        self.store = store
        self.device = device
        self.dim = tables[0].dim
        self.row_offset: dict[str, int] = {}
        offset = 0
        for t in tables:
            self.row_offset[t.name] = offset
            offset += t.num_rows
        self.num_rows = offset
        self.feature_row_offset = torch.tensor([self.row_offset[t] for t in feature_tables], dtype=torch.int64)
        # Which feature a fused row belongs to (statistics): offsets sorted, and
        # the feature index of each sorted offset. Features sharing a table
        # count toward one of them.
        order = torch.argsort(self.feature_row_offset, stable=True)
        self.feature_row_offset_sorted = self.feature_row_offset[order]
        self.feature_order = order

    # --- the step: called by the collection -------------------------------
    def prepare(self, plan: LookupPlan) -> None:
        """Make the plan's rows readable (a cache fills and pins them)."""

    @abc.abstractmethod
    def gather(self, plan: LookupPlan) -> torch.Tensor:
        """fp32 rows of plan.unique on the device."""

    @abc.abstractmethod
    def update(self, plan: LookupPlan, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply the row optimizer to the rows `gather` returned."""

    def release(self, plan: LookupPlan) -> None:
        """The trainer is done with the plan's rows."""

    @abc.abstractmethod
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Current fp32 rows, no side effects (evaluation, checks)."""

    # --- whole-table access: checkpoints and reports -----------------------
    def table_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per table, the current rows in the store's native tensors (rows in
        their precision and the optimizer state), as the store snapshots them
        (RowStore.table_snapshot: views of a host store; a disk store: the rows
        changed since its last checkpoint, written by the checkpoint). Reading
        it changes nothing in the live run; rows that live elsewhere (a cache's
        dirty rows) are patched into the snapshot."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for t in self.tables:
            lo, hi = self.row_offset[t.name], self.row_offset[t.name] + t.num_rows
            out[t.name] = self.store.table_snapshot(t, lo, hi, self._snapshot_patch(lo, hi))
        return out

    def _snapshot_patch(self, lo: int, hi: int):
        """(local ids, encoded rows, state) of rows of [lo, hi) that live
        elsewhere than the store (a cache), or None."""
        return None

    def cache_snapshot(self) -> dict | None:
        """What a checkpoint needs beyond table_state to resume exactly (a cache's slots)."""
        return None

    def load_cache_snapshot(self, saved: dict | None, step: int) -> bool:
        return saved is None

    def load_table_state(self, tables: dict[str, dict]) -> None:
        """Load what table_state wrote, from any placement (RowStore.load_table)."""
        for t in self.tables:
            lo = self.row_offset[t.name]
            self.store.load_table(t, lo, lo + t.num_rows, tables[t.name])
        self.invalidate()

    def invalidate(self) -> None:
        """Forget cached rows after the store was overwritten."""

    def memory(self) -> list[tuple[str, str, int]]:
        """Bytes actually allocated: (tier "device"|"host", what "table"|"cache"|"index", bytes)."""
        return self.store.memory(self.store_tier)

    def stats(self) -> dict:
        return self.store.stats()


class DirectGroup(TableGroup):
    """No cache: rows go between the store and the trainer every step. The
    store is fp32 (a low-precision table always sits behind a cache). With the
    store in host memory and the trainer on CUDA, rows and their optimizer
    state are gathered into reusable pinned buffers, so their copies to the
    device are asynchronous."""

    def __init__(self, *args, kind: str = "device", **kwargs) -> None:
        super().__init__(*args, store_tier="device" if kind == "device" else "host", **kwargs)
        self.kind = kind
        self.bytes_to_device = 0
        self.bytes_to_host = 0
        staged = self.store.device.type == "cpu" and self.device.type != "cpu"
        self.staging = self.make_staging(runtime_for(self.device)) if staged else None

    def make_staging(self, runtime) -> tuple[PinnedStaging, PinnedStaging]:
        """Staging buffers for rows and optimizer state (tests install a recording runtime's)."""
        return PinnedStaging(runtime, self.dim), PinnedStaging(runtime, self.store.state.shape[1])

    def _ids(self, plan: LookupPlan) -> torch.Tensor:
        """plan.unique where the store is: the copy the trainer made once per step."""
        if plan.unique.device == self.store.device:
            return plan.unique
        return plan.unique_device if plan.unique_device is not None else plan.unique.to(self.store.device)

    def _gather(self, source: torch.Tensor, ids: torch.Tensor, staging: PinnedStaging | None) -> torch.Tensor:
        if staging is None:
            return source.index_select(0, ids).to(self.device, non_blocking=True)
        view = staging.take(ids.numel())
        torch.index_select(source, 0, ids, out=view)
        return staging.to_device(view, self.device)

    def gather(self, plan: LookupPlan) -> torch.Tensor:
        ids = self._ids(plan)
        if self.store_tier == "host":  # counted on CPU runs too: the traffic a GPU would see
            self.bytes_to_device += ids.numel() * self.dim * 4
        return self._gather(self.store.rows.weights, ids, self.staging and self.staging[0])

    def update(self, plan: LookupPlan, rows: torch.Tensor, grad: torch.Tensor) -> None:
        ids = self._ids(plan)
        state = self._gather(self.store.state, ids, self.staging and self.staging[1])
        rows, state = self.optimizer.step(rows, state, grad)
        if self.store_tier == "host":
            self.bytes_to_host += rows.numel() * 4
        self.store.write(ids, rows.to(self.store.device), state.to(self.store.device))  # fp32: no rounding key

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        return self.store.rows.read(ids.to(self.store.device)).to(self.device)

    def stats(self) -> dict:
        if self.kind == "device":
            return {}
        return {"bytes_to_device": self.bytes_to_device, "bytes_to_host": self.bytes_to_host}
