"""U32Map: a vectorised open-addressing hash table from uint32 keys to integer values.

The Criteo preprocessor counts every sparse value in one of these per feature
(pass 1), so memory grows with the number of distinct values, not with rows;
every operation takes a whole numpy array of keys at a time.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["U32Map"]


class U32Map:
    """Open-addressing (linear probing) hash table from uint32 keys to
    integer values, operated on whole numpy arrays at a time. Slots hold
    key + 1 as uint64 (0 = empty), so one gather tells hit, miss and empty.
    With track_order, every key also gets its insertion index (0, 1, ...),
    which stays fixed when the table grows."""

    _GOLD = np.uint64(0x9E3779B97F4A7C15)
    MAX_LOAD = 0.6

    def __init__(self, capacity: int = 1024, dtype=np.int64, track_order: bool = False):
        bits = max(4, int(math.ceil(math.log2(max(capacity, 16)))))
        self.track_order = track_order
        self._alloc(bits, dtype)
        self.size = 0

    def _alloc(self, bits: int, dtype) -> None:
        self.bits = bits
        self.cap = 1 << bits
        self.mask = self.cap - 1
        self.slots = np.zeros(self.cap, dtype=np.uint64)  # key + 1, 0 = empty
        self.vals = np.zeros(self.cap, dtype=dtype)
        self.order = np.zeros(self.cap, dtype=np.int32) if self.track_order else None

    def _prep(self, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        v64 = v.astype(np.uint64)
        pos = ((v64 * self._GOLD) >> np.uint64(64 - self.bits)).view(np.int64)
        v64 += np.uint64(1)
        return v64, pos

    _WINDOW = np.arange(16, dtype=np.int64)

    def find(self, v: np.ndarray) -> np.ndarray:
        """Slot of each key, -1 where absent."""
        k1, pos = self._prep(v)
        got = self.slots[pos]
        hit = got == k1
        if hit.all():
            return pos
        out = np.where(hit, pos, -1)
        idx = np.flatnonzero(~hit & (got != 0))
        pos, kk = pos[idx] + 1, k1[idx]
        # Collisions: look at the next 16 slots at once (linear probing keeps
        # a key within its cluster), until a hit or an empty slot.
        while idx.size:
            win = (pos[:, None] + self._WINDOW) & self.mask
            got = self.slots[win]
            hit = got == kk[:, None]
            stop = hit | (got == 0)
            first = stop.argmax(axis=1)
            rows = np.arange(len(idx))
            stopped = stop[rows, first]
            found = stopped & hit[rows, first]
            out[idx[found]] = win[rows[found], first[found]]
            cont = ~stopped
            idx, pos, kk = idx[cont], pos[cont] + len(self._WINDOW), kk[cont]
        return out

    def _place(self, keys: np.ndarray, vals: np.ndarray | None, order: np.ndarray | None = None) -> np.ndarray:
        """Insert unique keys known to be absent; returns their slots.
        `order`: their insertion indices (default: the next ones)."""
        n = len(keys)
        if self.order is not None and order is None:
            order = np.arange(self.size, self.size + n, dtype=np.int32)
        out = np.empty(n, dtype=np.int64)
        k1, pos = self._prep(keys)
        pending = np.arange(n)
        single = True  # first try each key's own slot, then windows of 16
        while pending.size:
            if single:
                has = self.slots[pos] == 0
                target = pos
            else:
                win = (pos[:, None] + self._WINDOW) & self.mask
                empty = self.slots[win] == 0
                first = empty.argmax(axis=1)
                rows = np.arange(len(pending))
                has = empty[rows, first]
                target = win[rows, first]
            cand = np.flatnonzero(has)
            # Claim empty slots: when keys race for one slot the last write
            # wins; reading back tells the winners (keys are unique).
            tc = target[cand]
            self.slots[tc] = k1[cand]
            won = np.zeros(len(pending), dtype=bool)
            won[cand[self.slots[tc] == k1[cand]]] = True
            w = np.flatnonzero(won)
            if vals is not None:
                self.vals[target[w]] = vals[pending[w]]
            if self.order is not None:
                self.order[target[w]] = order[pending[w]]
            out[pending[w]] = target[w]
            keep = ~won
            # losers retry from the slot they lost; keys without an empty slot
            # in their window move on by a whole window
            step = 1 if single else len(self._WINDOW)
            nxt = np.where(has, target, pos + step) & self.mask
            pending, pos, k1 = pending[keep], nxt[keep], k1[keep]
            single = False
        self.size += n
        return out

    def _grow_for(self, extra: int) -> None:
        need = self.size + extra
        if need <= self.MAX_LOAD * self.cap:
            return
        bits = self.bits
        while need > self.MAX_LOAD * (1 << bits):
            bits += 1
        used = self.slots != 0
        old_keys, old_vals = self.items()
        old_order = self.order[used] if self.order is not None else None
        self._alloc(bits, self.vals.dtype)
        self.size = 0
        if len(old_keys):
            self._place(old_keys, old_vals, old_order)

    def insert(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Insert unique, absent keys with values."""
        self._grow_for(len(keys))
        self._place(np.asarray(keys, dtype=np.uint32), vals)

    def count(self, v: np.ndarray) -> np.ndarray | None:
        """Add one to the value of each key in v (keys are added as needed);
        with track_order, returns each key's insertion index."""
        if not len(v):
            return np.zeros(0, np.int32) if self.order is not None else None
        slots = self.find(v)
        missing = slots < 0
        if missing.any():
            new = np.unique(v[missing])
            cap = self.cap
            self._grow_for(len(new))
            self._place(new, None)
            if self.cap != cap:  # rebuilt: every slot moved
                slots = self.find(v)
            else:
                slots[missing] = self.find(v[missing])
        if self.cap <= 8 * len(v):
            self.vals += np.bincount(slots, minlength=self.cap).astype(self.vals.dtype, copy=False)
        else:
            np.add.at(self.vals, slots, 1)
        return self.order[slots] if self.order is not None else None

    def get(self, v: np.ndarray, default: int = 0) -> np.ndarray:
        slots = self.find(v)
        found = slots >= 0
        if found.all():
            return self.vals[slots]
        return np.where(found, self.vals[np.maximum(slots, 0)], default)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        used = self.slots != 0
        return (self.slots[used] - np.uint64(1)).astype(np.uint32), self.vals[used]

    def items_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        used = self.slots != 0
        return (self.slots[used] - np.uint64(1)).astype(np.uint32), self.vals[used], self.order[used]
