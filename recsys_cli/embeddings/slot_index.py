"""SlotIndex: which cache slot holds a row, in memory proportional to the cache.

A cache of C slots in front of a table of N rows needs row -> slot for the
rows it holds only. A dense map costs N entries however small C is (a 1 %
cache of a 30M-row table would pay for 30M entries); this one is an
open-addressing hash table of int64 keys (fused row ids) with linear probing,
sized once to the cache: 4C buckets, so it is never more than a quarter full
and costs 48 bytes per slot (BYTES_PER_SLOT), never anything per table row.

Every operation is vectorised over a batch of keys: a probe round looks up
all still-unresolved keys at once (a window of buckets each, for lookups),
and the rounds stop when none is left, so the Python loop runs a few times
per call, never once per id.
Inserts resolve collisions within a batch deterministically: the lowest
batch position wins a contested empty bucket, the others probe on. Removal
leaves a tombstone (lookups probe past it, inserts reuse it); when live
entries plus tombstones pass half of the buckets the table is rebuilt from its
live entries, so probe chains stay short under any insert/remove pattern.

The tensors live on the index's device (CPU or CUDA): the same code runs on
both. On CUDA each probe round reads back whether any key is unresolved (a
synchronisation), which is why the cache keeps its index on the host, beside
the host-built plans it is queried with.
"""

from __future__ import annotations

import torch

from recsys_cli.embeddings.counter import MASK32, mul32

EMPTY = -1
TOMBSTONE = -2
_MAX_FILL = 0.5  # live + tombstones above this fraction of the buckets: rebuild
_WINDOW = 4  # buckets a lookup probes per round
_GOLDEN = 0x9E3779B1  # 2**32 / the golden ratio, odd
BUCKETS_PER_SLOT = 4
BYTES_PER_SLOT = BUCKETS_PER_SLOT * (8 + 4)  # an int64 key and an int32 value per bucket


class SlotIndex:
    """A map of at most `capacity` distinct non-negative int64 keys to int64
    values (cache slots). lookup/insert/remove take 1-D int64 key tensors."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        if not 1 <= capacity < 1 << 29:
            raise ValueError(f"a slot index holds 1 to 2**29 - 1 keys, not {capacity}")
        self.capacity = capacity
        self.device = torch.device(device)
        self.num_buckets = BUCKETS_PER_SLOT * capacity  # < 2**31: the home bucket's product stays in int64
        self._steps = torch.arange(_WINDOW, device=self.device)
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
        """Each key's first bucket: Fibonacci hashing of the key's two halves
        folded to 32 bits, scaled to the bucket count (h * buckets / 2**32)."""
        return (mul32((keys ^ (keys >> 32)) & MASK32, _GOLDEN) * self.num_buckets) >> 32

    def _find(self, keys: torch.Tensor) -> torch.Tensor:
        """The bucket holding each key, -1 where it is absent. Probes a window
        of _WINDOW buckets per round: at a quarter full nearly every chain
        ends inside the first window, so one round resolves almost all keys."""
        found = torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
        at = torch.arange(keys.numel(), device=self.device)  # batch positions still probing
        want = keys
        pos = self._home(keys)
        while at.numel():
            window = (pos.unsqueeze(1) + self._steps) % self.num_buckets
            seen = self.keys.index_select(0, window.flatten()).view(window.shape)
            hit = seen == want.unsqueeze(1)
            ends = hit | (seen == EMPTY)  # an empty bucket ends the chain; a tombstone does not
            first = ends.to(torch.int8).argmax(1, keepdim=True)  # the first end in the window
            ended = ends.any(1)
            at_hit = hit.gather(1, first).squeeze(1)
            found.index_copy_(0, at, torch.where(at_hit, window.gather(1, first).squeeze(1), -1))
            going = torch.nonzero(~ended).flatten()
            at, want = at.index_select(0, going), want.index_select(0, going)
            pos = (pos.index_select(0, going) + _WINDOW) % self.num_buckets
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
            at, pos = at[going], (pos[going] + 1) % self.num_buckets
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
