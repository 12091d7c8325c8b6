"""Table rows' identity and initial values: TableSpec and the per-row deterministic build.

A table's initial rows are a function of (seed, table name, row) only, so
every placement, precision, chunking and process builds the same values;
`build_initial_rows` hands them, chunk by chunk, to whatever store holds
them (a RowStore in memory, a DiskRowStore's file). This module depends on
nothing else in embeddings/, so every store can use it.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import zlib
from dataclasses import dataclass

import torch

from recsys_cli.embeddings.counter import MASK32 as _MASK32
from recsys_cli.embeddings.counter import fmix32 as _fmix32


@dataclass(frozen=True)
class TableSpec:
    """A table, or a shard of one (embeddings/sharding.py): rows [first_row,
    first_row + num_rows) of the table `name` of table_num_rows rows. A shard
    is a table of num_rows rows to whatever holds it, and starts from the
    same values as those rows of the whole table."""

    name: str
    num_rows: int
    dim: int
    first_row: int = 0
    table_num_rows: int | None = None  # the whole table's rows (None: this is the whole table)

    @property
    def whole_rows(self) -> int:
        return self.num_rows if self.table_num_rows is None else self.table_num_rows


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
    for row, last, gen, scale in _block_streams(spec, row_start, row_end, seed):
        _draw(out[row - row_start : last - row_start], gen, scale)
    return out


def _block_streams(spec: TableSpec, row_start: int, row_end: int, seed: int):
    """(row, last, generator, scale) for each init block that rows
    [row_start, row_end) of `spec` touch: rows [row, last) of the spec come
    next from the generator, which has drawn the block's rows before `row`."""
    keys = table_key(spec.name, seed)
    bound = torch.tensor(1.0 / math.sqrt(spec.whole_rows), dtype=torch.float32).item()
    scale = bound / (1 << 23)  # codes in [-2**23, 2**23): values exact in fp32, strictly inside the bound
    gen = torch.Generator()
    # A shard's rows are rows of the whole table: blocks and streams count from the table's row 0.
    row, row_end = row_start + spec.first_row, row_end + spec.first_row
    while row < row_end:
        block = row // INIT_BLOCK_ROWS
        first = block * INIT_BLOCK_ROWS
        last = min(row_end, first + INIT_BLOCK_ROWS)
        gen.manual_seed(_block_seed(keys, block))
        _skip(gen, (row - first) * spec.dim)  # the block's stream from its first row: the rows before are drawn, unused
        yield row - spec.first_row, last - spec.first_row, gen, scale
        row = last


def _draw(dest: torch.Tensor, gen: torch.Generator, scale: float) -> None:
    """The next dest.numel() values of gen's stream into fp32 rows `dest`.

    The codes go straight into the fp32 rows: a float random_(a, b) is
    float(a + word % (b - a)) of one 32-bit word a value, the int32 draw's
    code exactly (|code| <= 2**23), without an int32 buffer and its copy."""
    dest.random_(-(1 << 23), 1 << 23, generator=gen)
    piece = max(1, _SERIAL_ELEMENTS // max(1, dest.shape[1]))
    for p in range(0, dest.shape[0], piece):  # pieces under torch's grain size: no OpenMP team per op
        dest[p : p + piece].mul_(scale)


def _skip(gen: torch.Generator, values: int) -> None:
    """Advance gen past `values` draws of _draw (one 32-bit word each)."""
    scratch = torch.empty(min(values, _SERIAL_ELEMENTS))
    while values > 0:
        scratch[: min(values, scratch.numel())].random_(-(1 << 23), 1 << 23, generator=gen)
        values -= scratch.numel()


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


# Rows handed to a write at a time: one piece of fp32 values (at most 4 MiB)
# and the quantizer's temporaries are all a build thread holds beyond the
# table itself.
CHUNK_ELEMENTS = 1 << 20


def build_initial_rows(specs: list[TableSpec], seed: int, write, chunk_rows: int | None = None, into=None,
                       workers: int = 1) -> None:
    """Build tables `specs`, fused in order, straight into their destination:
    the initial fp32 rows of fused rows [start, start + n) go to
    write(start, rows) (rows: a CPU fp32 [n, dim] buffer reused for the next
    piece: copy or encode it before returning), n <= chunk_rows (default
    CHUNK_ELEMENTS // dim) and never past an init block. into(start, end), if
    given, may instead return a CPU fp32 view of the destination to fill in
    place (an fp32 host table), or None. The values do not depend on
    chunk_rows nor on `workers`. A store in any precision and location
    (RowStore.write_initial), or a file on disk, is built this way.

    The unit of work is one init block of a table (INIT_BLOCK_ROWS rows of
    the whole table), its stream drawn once, in order, piece after piece: a
    piece that started its block's stream again drew the rows before it too
    (chunks of 512 rows drew 4.5x the values they kept, the largest cost of
    a disk build). workers > 1 builds blocks on that many threads at once
    (write and into are then called concurrently, for disjoint rows). Every
    torch op of the build runs on one intra-op thread: the ops are small and
    many, and an OpenMP team per op on a loaded machine spins and waits for
    its slowest member (measured: 26x the CPU time of one thread with two of
    them)."""
    if not specs:
        return
    dim = specs[0].dim
    piece_rows = max(1, min(chunk_rows or CHUNK_ELEMENTS // dim, INIT_BLOCK_ROWS))
    blocks = []
    start = 0
    for spec in specs:
        lo = 0
        while lo < spec.num_rows:  # block boundaries of the whole table, in the spec's rows
            hi = min(spec.num_rows, ((spec.first_row + lo) // INIT_BLOCK_ROWS + 1) * INIT_BLOCK_ROWS - spec.first_row)
            blocks.append((spec, start, lo, hi))
            lo = hi
        start += spec.num_rows
    local = threading.local()

    def build(block) -> None:
        spec, start, lo, hi = block
        view = into(start + lo, start + hi) if into is not None else None
        if view is not None:
            init_into(view, spec, lo, seed)
            return
        if getattr(local, "buffer", None) is None:
            local.buffer = torch.empty(piece_rows, dim)
        ((_, _, gen, scale),) = _block_streams(spec, lo, hi, seed)
        for row in range(lo, hi, piece_rows):
            rows = local.buffer[: min(hi, row + piece_rows) - row]
            _draw(rows, gen, scale)
            write(start + row, rows)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if workers <= 1 or len(blocks) == 1:
            for block in blocks:
                build(block)
        else:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                for done in pool.map(build, blocks):  # re-raises a block's error
                    del done
    finally:
        torch.set_num_threads(threads)
