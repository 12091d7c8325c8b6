"""SlotIndex: which cache slot holds a row, in memory proportional to the cache.

A cache of C slots in front of a table of N rows needs row -> slot for the
rows it holds only. A dense map costs N entries however small C is (a 1 %
cache of a 30M-row table would pay for 30M entries); this one is an
open-addressing hash table of keys (fused row ids) with linear probing,
sized once to the cache: 2C buckets, so it is never more than half full
of live entries, each bucket an int32 value (the slot) and a key: int32 when
every key is below 2**31 - 2 (`max_key`, the table's row count: Criteo's
largest group has 34M rows), else int64. That is 16 bytes per slot
(24 with int64 keys; index_bytes), never anything per table row.

Every operation is vectorised over a batch of keys: a probe round reads a
window of buckets for every still-unresolved key at once (a lookup reads
each key's home bucket alone first), and the rounds stop when none is left,
so the Python loop runs a few times per call, never once per id. Its cost
is the number of torch ops, not their size, so the window widens from
round to round (8, 32, 128, then 512 buckets): the keys left after the
first window are few, and at a full cache a few of them have long chains
(a lookup of a batch of 2048 at a full 1 % cache took 7 rounds of 8).
Inserts resolve collisions within a batch deterministically: each key claims
the first free bucket of its window, the lowest batch position wins a
contested one, the others probe on past it. Removal
leaves a tombstone (lookups probe past it, inserts reuse it); when live
entries plus tombstones would pass 80 % of the buckets (MAX_FILL) the table
is rebuilt from its live entries, so probe chains stay bounded under any
insert/remove pattern (half of the buckets live when the cache is full).

The tensors live on the index's device (CPU or CUDA): the same code runs on
both. On CUDA each probe round reads back whether any key is unresolved (a
synchronisation), which is why the cache keeps its index on the host, beside
the host-built plans it is queried with.
"""

from __future__ import annotations

import sys

import torch

from recsys_cli.embeddings.counter import MASK32, mul32

EMPTY = -1
TOMBSTONE = -2
MAX_FILL = 0.8  # live + tombstones above this fraction of the buckets: rebuild
_WINDOW = 8  # buckets the first probe round reads per key: a window's mask of 8 bools is one int64 (_first)
# Each later round reads _GROWTH times more buckets a key, up to _MAX_WINDOW: the keys still
# probing are few, and their chains long (a lookup at a full 1 % cache took 7 rounds of
# about 30 torch ops each, most on a few dozen keys; the ops, not the reads, are the cost).
_GROWTH = 4
_MAX_WINDOW = 512
_GOLDEN = 0x9E3779B1  # 2**32 / the golden ratio, odd
INT32_KEYS_BELOW = (1 << 31) - 2  # keys up to here fit int32 beside EMPTY and TOMBSTONE
if sys.byteorder != "little":  # _first reads a row of bools as one little-endian int64
    raise ImportError("recsys's slot index needs a little-endian machine")


def num_buckets(capacity: int) -> int:
    """2 buckets per key: at most half full of live entries (a count linear in
    the capacity, so the planner's per-table sum is a fused group's bytes)."""
    return 2 * capacity


def key_dtype(max_key: int | None) -> torch.dtype:
    """int32 keys when every key is at most max_key < INT32_KEYS_BELOW, else int64."""
    return torch.int32 if max_key is not None and max_key < INT32_KEYS_BELOW else torch.int64


def key_bytes(max_key: int | None) -> int:
    """Bytes of one key of at most max_key (key_dtype's size)."""
    return 4 if key_dtype(max_key) == torch.int32 else 8


def index_bytes(capacity: int, max_key: int | None = None) -> int:
    """Bytes of a SlotIndex of `capacity` keys of at most `max_key` (None: any int64):
    per bucket a key and an int32 value."""
    return num_buckets(capacity) * (key_bytes(max_key) + 4)


class SlotIndex:
    debug_bounds = True  # check inserted keys against max_key (one max per insert)
    """A map of at most `capacity` distinct non-negative int64 keys to int64
    values (cache slots). lookup/insert/remove take 1-D int64 key tensors;
    `max_key`: no key is larger (the table's rows - 1), so keys may be held as int32."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu", max_key: int | None = None) -> None:
        if not 1 <= capacity < 1 << 29:
            raise ValueError(f"a slot index holds 1 to 2**29 - 1 keys, not {capacity}")
        self.capacity = capacity
        self.device = torch.device(device)
        self.num_buckets = num_buckets(capacity)  # < 2**31: the home bucket's product stays in int64
        self.max_key = max_key
        self.keys = torch.full((self.num_buckets,), EMPTY, dtype=key_dtype(max_key), device=self.device)
        # The windows that do not run past the last bucket are the rows of an unfold view (one per
        # window width, made on first use), gathered with one index per key (a [_WINDOW, n] gather
        # of bucket numbers, each taken modulo the bucket count, was 60 % of a lookup of 250k
        # keys); the few that wrap are gathered that way.
        self._windows: dict[int, torch.Tensor] = {}
        # Slots fit in int32 (a cache has far fewer than 2**31 slots).
        self.values = torch.full((self.num_buckets,), -1, dtype=torch.int32, device=self.device)
        self.size = 0  # live entries
        self.tombstones = 0

    def __len__(self) -> int:
        return self.size

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def _as_key(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 query keys in the index's key dtype, so a comparison with stored keys
        copies nothing; a key beyond int32's range, which no int32 entry holds, becomes
        one that no bucket holds (below TOMBSTONE), not its wrapped low bits."""
        if self.keys.dtype == torch.int64:
            return keys
        return torch.where(keys > INT32_KEYS_BELOW, TOMBSTONE - 1, keys).to(self.keys.dtype)

    def _home(self, keys: torch.Tensor) -> torch.Tensor:
        """Each key's first bucket: Fibonacci hashing of the key's two halves
        folded to 32 bits, scaled to the bucket count (h * buckets / 2**32)."""
        return (mul32((keys ^ (keys >> 32)) & MASK32, _GOLDEN) * self.num_buckets) >> 32

    def _widths(self):
        """The window width of each probe round: _WINDOW, then _GROWTH times the
        last, up to _MAX_WINDOW (and never past the bucket count)."""
        width = _WINDOW
        while True:
            yield min(width, self.num_buckets)
            width = min(width * _GROWTH, _MAX_WINDOW)

    def _window(self, pos: torch.Tensor, width: int) -> torch.Tensor:
        """The keys in the `width` buckets from each of `pos` (wrapping past
        the last bucket to the first), as [n, width]."""
        last_start = self.num_buckets - width  # the last window that does not wrap
        windows = self._windows.get(width)
        if windows is None:
            windows = self._windows[width] = self.keys.unfold(0, width, 1)
        seen = windows.index_select(0, pos.clamp(max=last_start))
        wrapping = torch.nonzero(pos > last_start).flatten()
        if wrapping.numel():
            seen.index_copy_(0, wrapping, self._wrapped(pos.index_select(0, wrapping), width))
        return seen

    def _wrapped(self, pos: torch.Tensor, width: int) -> torch.Tensor:
        window = (pos.unsqueeze(1) + torch.arange(width, device=self.device)) % self.num_buckets
        return self.keys.index_select(0, window.view(-1)).view(window.shape)

    @staticmethod
    def _first(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(whether each row of an [n, width] mask has a True, the column of
        its first True, 0 where none). At the first round's width a row's 8
        bools (bytes 0 or 1) read as one little-endian int64: its lowest set
        bit, word & -word, is bit 8k for the first True in column k, and frexp
        gives 2**8k's exponent, 8k + 1, exactly (one pass over n words; argmax
        over short rows costs several times more). The wider rounds have few
        rows: argmax, which returns the first of equal maxima."""
        if mask.shape[1] != _WINDOW:
            return mask.any(1), mask.to(torch.uint8).argmax(1)
        word = mask.view(torch.int64).view(-1)
        lowest = (word & -word).clamp_(min=1)  # a row without a True: 1, column 0
        return word != 0, (torch.frexp(lowest.to(torch.float64)).exponent.to(torch.int64) - 1) >> 3

    def _find(self, keys: torch.Tensor) -> torch.Tensor:
        """The bucket holding each key, -1 where it is absent. Most keys end
        at their home bucket (found there, or an empty one ends the chain),
        so a first round reads that one bucket a key; the rest probe a window
        of _WINDOW buckets a round from the bucket after it. Reading the home
        alone first took the lookups of a batch of 16384 from 7.5-8.2 to
        5.9-6.3 ms at a 1 % cache of Kaggle's tables, from 7.3-7.5 to 4.3-4.5
        at 5 % (bench/cache_fill_bench.py, one compute thread)."""
        want = self._as_key(keys)
        pos = self._home(keys)
        home = self.keys.index_select(0, pos)
        found = torch.where(home == want, pos, -1)
        at = torch.nonzero((home != want) & (home != EMPTY)).flatten()  # batch positions still probing
        want, pos = want.index_select(0, at), (pos.index_select(0, at) + 1) % self.num_buckets
        widths = self._widths()
        while at.numel():
            width = next(widths)
            seen = self._window(pos, width)
            ended, first = self._first((seen == want.unsqueeze(1)) | (seen == EMPTY))  # an empty bucket ends the chain; a tombstone does not
            end = (pos + first) % self.num_buckets
            found.index_copy_(0, at, torch.where(self.keys.index_select(0, end) == want, end, -1))
            going = torch.nonzero(~ended).flatten()
            at, want = at.index_select(0, going), want.index_select(0, going)
            pos = (pos.index_select(0, going) + width) % self.num_buckets
        return found

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 values of `keys` (any shape), -1 where a key is absent."""
        flat = keys.reshape(-1).to(device=self.device, dtype=torch.int64)
        if flat.numel() == 0 or self.size == 0:
            return torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
        found = self._find(flat)
        out = torch.where(found >= 0, self.values.index_select(0, found.clamp(min=0)).to(torch.int64), -1)
        return out.view(keys.shape)

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        return self.lookup(keys) >= 0

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add distinct keys that are not in the index, with their values."""
        keys = keys.reshape(-1).to(device=self.device, dtype=torch.int64)
        values = values.reshape(-1).to(device=self.device, dtype=torch.int32)
        n = keys.numel()
        if n == 0:
            return
        if self.size + n > self.capacity:
            raise ValueError(f"slot index full: {self.size} + {n} keys exceed its capacity of {self.capacity}")
        if self.max_key is not None and self.debug_bounds and int(keys.max()) > self.max_key:
            raise ValueError(f"key {int(keys.max())} above the index's max_key {self.max_key}")
        if self.size + self.tombstones + n > MAX_FILL * self.num_buckets:
            self._rebuild()
        self._place(keys, values)
        self.size += n

    def _place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put keys (absent from the index) into free buckets. A probe round
        looks at a window of _WINDOW buckets per key, as _find does, and each
        key claims the first free bucket of its window; of the keys that
        claim one bucket in a round, the lowest batch position takes it (a
        min over positions: order-free, so the layout is deterministic) and
        the others probe on past it. Every bucket a key skipped was occupied,
        so its chain from home has no empty bucket: _find reaches it."""
        at = torch.arange(keys.numel(), device=self.device, dtype=torch.int32)  # batch positions still placing
        pos = self._home(keys)
        reused = torch.zeros((), dtype=torch.int64, device=self.device)
        widths = self._widths()
        while True:
            width = next(widths)
            has_free, first = self._first(self._window(pos, width) < 0)  # EMPTY or TOMBSTONE
            bucket = (pos + first) % self.num_buckets
            claims = torch.nonzero(has_free).flatten()
            claimed = bucket.index_select(0, claims)
            claimant = at.index_select(0, claims)
            # A free bucket's value is -1 and never read: the claimants'
            # lowest position goes there, and the claimant that finds its own wins.
            self.values.scatter_reduce_(0, claimed, claimant, "amin", include_self=False)
            won_mask = self.values.index_select(0, claimed) == claimant
            won, won_bucket = claims[won_mask], claimed[won_mask]
            reused += (self.keys.index_select(0, won_bucket) == TOMBSTONE).sum()
            self.keys.index_copy_(0, won_bucket, keys.index_select(0, won).to(self.keys.dtype))
            self.values.index_copy_(0, won_bucket, values.index_select(0, won))
            if won.numel() == at.numel():
                break
            # Losers probe on after the bucket they lost, the others after their window.
            going = torch.ones(at.numel(), dtype=torch.bool, device=self.device)
            going[won] = False
            going = torch.nonzero(going).flatten()
            pos = torch.where(has_free, bucket + 1, pos + width).index_select(0, going) % self.num_buckets
            at, keys, values = at.index_select(0, going), keys.index_select(0, going), values.index_select(0, going)
        self.tombstones -= int(reused)

    def remove(self, keys: torch.Tensor, distinct: bool = False) -> int:
        """Remove the keys that are in the index (others are ignored); the number
        removed. distinct: no key is listed twice (a cache's victims' rows), so
        the sort that removes a repeated key once is skipped."""
        keys = keys.reshape(-1).to(device=self.device, dtype=torch.int64)
        if keys.numel() == 0 or self.size == 0:
            return 0
        found = self._find(keys)
        gone = found[found >= 0]
        if not distinct:
            gone = torch.unique(gone)  # a key listed twice is removed once
        self.keys[gone] = TOMBSTONE
        self.values[gone] = -1
        self.size -= gone.numel()
        self.tombstones += gone.numel()
        if self.size == 0:  # nothing to keep: start clean instead of probing past tombstones
            self.clear()
        return gone.numel()

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of every entry, in bucket order."""
        live = torch.nonzero(self.keys >= 0).flatten()
        return self.keys[live].to(torch.int64), self.values[live].to(torch.int64)

    def clear(self) -> None:
        self.keys.fill_(EMPTY)
        self.values.fill_(-1)
        self.size = self.tombstones = 0

    def _rebuild(self) -> None:
        """Rehash the live entries into clean buckets (drops the tombstones)."""
        keys, values = self.items()
        self.clear()
        self.insert(keys, values)
