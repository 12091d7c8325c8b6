"""SlotIndex: which cache slot holds a row, in memory proportional to the cache.

A cache of C slots in front of a table of N rows needs row -> slot for the
rows it holds only. A dense map costs N entries however small C is (a 1 %
cache of a 30M-row table would pay for 30M entries); this one is an
open-addressing hash table of int64 keys (fused row ids) with linear probing,
sized once to the cache: 2**k buckets for at least 2C, so it never exceeds
half full and costs about 24-48 bytes per slot, never per table row.

Every operation is vectorised over a batch of keys: a probe round looks up
all still-unresolved keys at once, and the rounds stop when none is left, so
the Python loop runs once per probe distance (a handful), not once per id.
Inserts resolve collisions within a batch deterministically: the lowest
batch position wins a contested empty bucket, the others probe on. Removal
leaves a tombstone (lookups probe past it, inserts reuse it); when live
entries plus tombstones pass 3/4 of the buckets the table is rebuilt from its
live entries, so probe chains stay short under any insert/remove pattern.

The tensors live on the index's device (CPU or CUDA): the same code runs on
both. On CUDA each probe round reads back whether any key is unresolved (a
synchronisation), which is why the cache keeps its index on the host, beside
the host-built plans it is queried with.
"""

from __future__ import annotations

import torch

from recsys_cli.embeddings.counter import MASK32, fmix32

EMPTY = -1
TOMBSTONE = -2
_MAX_FILL = 0.75  # live + tombstones above this fraction of the buckets: rebuild


def _buckets_for(capacity: int) -> int:
    buckets = 16
    while buckets < 2 * capacity:
        buckets *= 2
    return buckets


class SlotIndex:
    """A map of at most `capacity` distinct non-negative int64 keys to int64
    values (cache slots). lookup/insert/remove take 1-D int64 key tensors."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        if capacity < 1:
            raise ValueError(f"a slot index needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self.device = torch.device(device)
        self.num_buckets = _buckets_for(capacity)
        self._mask = self.num_buckets - 1
        self.keys = torch.full((self.num_buckets,), EMPTY, dtype=torch.int64, device=self.device)
        # Slots fit in int32 (a cache has far fewer than 2**31 slots).
        self.values = torch.full((self.num_buckets,), -1, dtype=torch.int32, device=self.device)
        self.size = 0  # live entries
        self.tombstones = 0

    def __len__(self) -> int:
        return self.size

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def _home(self, keys: torch.Tensor) -> torch.Tensor:
        """Each key's first bucket: a 32-bit hash of both halves of the key."""
        return fmix32((keys & MASK32) ^ fmix32(keys >> 32)) & self._mask

    def _find(self, keys: torch.Tensor) -> torch.Tensor:
        """The bucket holding each key, -1 where it is absent."""
        found = torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
        at = torch.arange(keys.numel(), device=self.device)  # batch positions still probing
        want = keys
        pos = self._home(keys)
        while at.numel():
            seen = self.keys[pos]
            hit = seen == want
            found[at[hit]] = pos[hit]
            going = ~hit & (seen != EMPTY)  # an empty bucket ends the chain; a tombstone does not
            at, want, pos = at[going], want[going], (pos[going] + 1) & self._mask
        return found

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 values of `keys` (any shape), -1 where a key is absent."""
        flat = keys.reshape(-1).to(device=self.device, dtype=torch.int64)
        if flat.numel() == 0 or self.size == 0:
            return torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
        found = self._find(flat)
        out = torch.where(found >= 0, self.values[found.clamp(min=0)].to(torch.int64), -1)
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
        if self.size + self.tombstones + n > _MAX_FILL * self.num_buckets:
            self._rebuild()
        at = torch.arange(n, device=self.device)
        pos = self._home(keys)
        reused = 0
        while at.numel():
            seen = self.keys[pos]
            free = torch.nonzero((seen == EMPTY) | (seen == TOMBSTONE)).flatten()
            # Of the keys that reached the same free bucket this round, the
            # lowest batch position takes it (a stable sort keeps `at`'s order).
            order = torch.argsort(pos[free], stable=True)
            free = free[order]
            first = torch.ones(free.numel(), dtype=torch.bool, device=self.device)
            first[1:] = pos[free[1:]] != pos[free[:-1]]
            won = free[first]
            won_pos = pos[won]
            reused += int((seen[won] == TOMBSTONE).sum())
            self.keys[won_pos] = keys[at[won]]
            self.values[won_pos] = values[at[won]]
            going = torch.ones(at.numel(), dtype=torch.bool, device=self.device)
            going[won] = False
            at, pos = at[going], (pos[going] + 1) & self._mask
        self.size += n
        self.tombstones -= reused

    def remove(self, keys: torch.Tensor) -> int:
        """Remove the keys that are in the index (others are ignored); the number removed."""
        keys = keys.reshape(-1).to(device=self.device, dtype=torch.int64)
        if keys.numel() == 0 or self.size == 0:
            return 0
        found = self._find(keys)
        gone = torch.unique(found[found >= 0])  # a key listed twice is removed once
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
        return self.keys[live], self.values[live].to(torch.int64)

    def clear(self) -> None:
        self.keys.fill_(EMPTY)
        self.values.fill_(-1)
        self.size = self.tombstones = 0

    def _rebuild(self) -> None:
        """Rehash the live entries into clean buckets (drops the tombstones)."""
        keys, values = self.items()
        self.clear()
        self.insert(keys, values)
