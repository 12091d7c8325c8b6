"""What a table costs in bytes in each placement: the byte model the placement search, the memory plan and the shard plan count with.

The byte counts follow what the groups really allocate (see
TableGroup.memory and CachedGroup.memory): a device table is rows x (dim +
state) fp32 values; a cache is slots x (dim + state) fp32 values on the
device, and its index (row-to-slot map, slot maps, pins, dirty bits, victim
scores, LFU use counts) lives in host memory. On CUDA the budget holds the
allocator's bytes, not the tensors': the caching allocator counts each
tensor as a block rounded up to 512 bytes (and a block over 1 MiB may keep up
to 1 MiB more of its segment unsplit): device_allocations and
allocator_block_bytes count that rounding. parse_bytes reads a budget
("64MiB" -> 67108864).
"""

from __future__ import annotations

import re

from recsys_cli.embeddings.slot_index import index_bytes as slot_map_bytes
from recsys_cli.embeddings.slot_index import key_bytes
from recsys_cli.embeddings.table_init import TableSpec
from recsys_cli.errors import UserError

BUDGET_KEY = "placement.device_memory_budget"
HOST_BUDGET_KEY = "placement.host_memory_budget"
PRECISIONS = ("fp32", "fp16", "int8", "int4")

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)

# Host bytes of a cache's index (CachedGroup), all per slot (a lookahead
# cache has no LFU admission, so no per-row row_uses): the slot index (a hash
# map sized to the cache), row_of_slot (the slot index's key dtype: int32
# below 2**31 rows), dirty (bool), score (int32), free_slots (int32), the
# room search's scratch (int32, window_protection.py), the victim order's scratch
# (6 bytes, slot_order.py). Not planned: the victim order's entries (none
# when the cache is built, at most 8 bytes a slot and a batch later) and
# debug runs' pins (int32).
INDEX_BYTES_PER_ROW = 0
SLOT_METADATA_BYTES = 1 + 4 + 4 + 4 + 6


def cache_index_bytes(slots: int, num_rows: int) -> int:
    """A cache index's host bytes: `slots` slots in front of a table of
    `num_rows` rows (int32 keys and rows below 2**31 rows)."""
    return slot_index_bytes(slots, num_rows) + slots * (key_bytes(num_rows - 1) + SLOT_METADATA_BYTES)
# Per host-cache slot of a disk store (disk_store.py): its row (int64), dirty bit, LRU score (int64).
HOST_CACHE_BYTES_PER_SLOT = 8 + 1 + 8


# --- sizes ------------------------------------------------------------------------
def parse_bytes(text: str | int, key: str = BUDGET_KEY) -> int:
    """A byte count from "1048576", "500MB" (10^6), "64MiB" (2^20), "2GiB", "1.5GB".

    Units are case-insensitive; KB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB binary.
    Bad text raises UserError naming `key`."""
    if isinstance(text, bool):
        raise UserError(f"{key}={text!r} is not a size")
    if isinstance(text, int):
        if text < 0:
            raise UserError(f"{key}={text} is negative")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UserError(
            f"{key}={text!r} is not a size: write bytes (1048576) or a number with a unit "
            "(500MB, 64MiB, 2GiB; KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_count(n: int) -> str:
    """10.1M, 25.0K, 999."""
    for div, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def host_row_bytes(dim: int, precision: str, state: int = 0) -> int:
    """Bytes of one row in a RowStore of `precision` (quant.py), optimizer state included."""
    if precision == "fp32":
        values = dim * 4
    elif precision == "fp16":
        values = dim * 2
    elif precision == "int8":
        values = dim + 4  # uint8 codes, fp16 scale and bias
    elif precision == "int4":
        values = (dim + 1) // 2 + 4
    else:
        raise UserError(f"precision.kind={precision!r} is not one of {', '.join(PRECISIONS)}")
    return values + state * 4


def device_row_bytes(dim: int, state: int = 0) -> int:
    """Bytes of one fp32 row and its state: a device table row or a cache slot."""
    return (dim + state) * 4


# The CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): every block
# is a multiple of kMinBlockSize; blocks up to kSmallSize come from the small
# pool and are split to their size, a larger block is split only when more
# than kSmallSize would remain, so it may hold up to kSmallSize beyond its size.
CUDA_BLOCK_BYTES = 512
CUDA_SMALL_BLOCK_BYTES = 1 << 20


def allocator_block_bytes(nbytes: int) -> int:
    """The most device bytes the CUDA caching allocator counts
    (memory_allocated) for one tensor of `nbytes` bytes."""
    if nbytes <= 0:
        return 0
    block = -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return block if block <= CUDA_SMALL_BLOCK_BYTES else block + CUDA_SMALL_BLOCK_BYTES


def device_allocations(tables: list[TableSpec], placements: dict[str, str], cache: dict[str, int],
                       state: int) -> list[int]:
    """Bytes of each device tensor build_embeddings allocates for a placement: one
    fused group per placement kind, each an fp32 rows tensor and an optimizer
    state tensor (device tables: the tables themselves; lookahead and disk
    tables: their cache's slots). Empty tensors take no block."""
    per_kind: dict[str, list[int]] = {}
    for t in tables:
        kind = placements[t.name]
        rows = t.num_rows if kind == "device" else cache[t.name]
        sizes = per_kind.setdefault(kind, [0, 0])
        sizes[0] += rows * t.dim * 4
        sizes[1] += rows * state * 4
    return [n for sizes in per_kind.values() for n in sizes if n]


def allocator_reserve(state: int, large: bool = False) -> int:
    """The most bytes the CUDA allocator's rounding adds to a split placement's
    tensors, a rows and a state tensor per placement kind (device, lookahead,
    disk; counted with or without a host budget, so that giving one does not
    change the device placement): 511 each, 1 MiB more each if `large` (tensors
    over 1 MiB)."""
    tensors = 3 * (2 if state else 1)
    return tensors * (CUDA_BLOCK_BYTES - 1 + (CUDA_SMALL_BLOCK_BYTES if large else 0))


def allocated_device_bytes(allocations: list[int]) -> int:
    """The most bytes the CUDA allocator counts for these tensors."""
    return sum(allocator_block_bytes(n) for n in allocations)


def table_footprint(t: TableSpec, placement: str, cache: int, precision: str, state: int, policy: str,
                    host_cache_ratio: float = 0.05) -> dict[str, int]:
    """Bytes of table `t` placed so ("device", "lookahead" with `cache`
    slots, "disk"): {"device", "host"} and, on disk, "disk"."""
    if placement == "device":
        return {"device": t.num_rows * device_row_bytes(t.dim, state), "host": 0}
    index = t.num_rows * INDEX_BYTES_PER_ROW + (cache_index_bytes(cache, t.num_rows) if cache else 0)
    row = host_row_bytes(t.dim, precision, state)
    if placement == "disk":  # rows in a file; host memory: the host cache, its index, the device cache's index
        host_rows = int(round(t.num_rows * host_cache_ratio))
        return {"device": cache * device_row_bytes(t.dim, state),
                "host": host_rows * (row + HOST_CACHE_BYTES_PER_SLOT) + slot_index_bytes(host_rows, t.num_rows) + index,
                "disk": t.num_rows * row}
    return {"device": cache * device_row_bytes(t.dim, state), "host": t.num_rows * row + index}


def slot_index_bytes(capacity: int, num_rows: int) -> int:
    """Bytes of a SlotIndex of `capacity` keys of a table of `num_rows` rows (slot_index.py)."""
    return slot_map_bytes(max(capacity, 1), num_rows - 1)
