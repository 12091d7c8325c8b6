"""SlotOrder: a cache's slots in eviction order, without a pass over every slot.

The cache evicts by (key, slot), smallest first: the key is the LRU clock of
the slot's last prepare, or its LFU use count; ties go to the lower slot. A
pass over all C slots per batch (a mask, a top-k) costs O(C) where a batch
touches O(B) rows: 1.7M slots for a 5 % cache of Criteo Kaggle against a few
thousand rows a batch. SlotOrder keeps, per key, the slots pushed with that
key; an entry is current while its slot still has that key (`current(slots)`
answers, -1 for a free slot), so a slot whose key changed simply gets a new
entry and the old one is dropped when it is next read. A batch then costs
what it touches: its pushes, and the entries read until enough current,
unprotected ones are found (each stale entry is read once, then dropped).

Buckets hold segments (one per push); taking victims reads the smallest
buckets whole (the lowest slots of the last one by a top-k, not a sort) and
compacts them, so an LFU bucket that many batches pushed into costs its size
once per eviction pass, which frees a chunk of slots: amortised O(1) a slot.
Entries left stale beyond `compact_at` times the slots are swept by a
compaction (each bucket keeps its current entries), amortised over as many
pushes.

Memory (issue 27: the index cost more than the cache): entries are int32
slots (a cache has far fewer than 2**31), one per resident slot plus the
stale ones (at most `compact_at` times the slots in all, then a compaction),
and the scratch is 6 bytes a slot: with compact_at=2 (a cache's victim
order) at most 14 bytes a slot and one batch's pushes (`nbytes` counts them).
An order read by min_key (LFU admission) keeps compact_at=4: min_key reads
a bucket's segments until one has an unprotected slot, and right after a
compaction the smallest bucket is one segment of many slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_EMPTY = torch.zeros(0, dtype=torch.int64)
_SLOT = torch.int32  # entries and scratch positions: slots < 2**31


class SlotOrder:
    def __init__(self, capacity: int, current: Callable[[torch.Tensor], torch.Tensor], compact_at: int = 4) -> None:
        """current(slots) -> integer keys the slots have now (-1: no row)."""
        self.capacity = capacity
        self.current = current
        self.compact_at = compact_at
        self._buckets: dict[int, list[torch.Tensor]] = {}
        self._entries = 0
        # Scratch, sized to the slots, set and reset at the entries of one call
        # (never filled whole): protected slots, slots taken, a slot's entry.
        self._mask = torch.zeros(capacity, dtype=torch.bool)
        self._taken = torch.zeros(capacity, dtype=torch.bool)
        self._where = torch.full((capacity,), -1, dtype=_SLOT)

    def nbytes(self) -> int:
        """Bytes held now: the entries and the scratch."""
        scratch = sum(t.numel() * t.element_size() for t in (self._mask, self._taken, self._where))
        return scratch + self._entries * torch.empty(0, dtype=_SLOT).element_size()

    def clear(self) -> None:
        self._buckets.clear()
        self._entries = 0

    def push(self, slots: torch.Tensor, keys: torch.Tensor | int) -> None:
        """The slots (distinct) now have these keys (one key for all, or one per slot)."""
        if slots.numel() == 0:
            return
        if isinstance(keys, int):
            self._add(keys, slots)
        else:
            order = torch.argsort(keys, stable=True)
            distinct, counts = torch.unique_consecutive(keys[order], return_counts=True)
            for key, part in zip(distinct.tolist(), torch.split(slots[order], counts.tolist())):
                self._add(key, part)
        if self._entries > self.compact_at * self.capacity:
            self.compact()

    def rebuild(self, slots: torch.Tensor | None = None) -> None:
        """Forget every entry and push `slots` (None: every slot) with their current keys."""
        if slots is None:
            slots = torch.arange(self.capacity)
        self.clear()
        keys = self.current(slots)
        held = keys >= 0
        self.push(slots[held], keys[held])

    def compact(self) -> None:
        """Keep only each bucket's current entries, one per slot: the order
        rebuild() would make (every current slot has an entry under its key),
        by one pass over each bucket's entries instead of a sort of every
        slot by key: the victim order of a 1 % cache of Kaggle's tables at
        batch 16384 cost 2.1-2.5 ms a batch with sorts, 1.0 with this
        (bench/cache_fill_bench.py)."""
        for key in list(self._buckets):
            held = sum(t.numel() for t in self._buckets[key])
            live = self._live(key)
            self._entries -= held - live.numel()
            if live.numel():
                self._buckets[key] = [live]
            else:
                del self._buckets[key]

    def _live(self, key: int) -> torch.Tensor:
        """The current entries of a bucket, one per slot."""
        segments = self._buckets[key]
        entries = torch.cat(segments) if len(segments) > 1 else segments[0]
        live = entries[self.current(entries) == key]
        if len(segments) > 1:  # one push names a slot once: only segments repeat slots
            live = live[self._first_copy(live)]
        return live

    def _add(self, key: int, slots: torch.Tensor) -> None:
        self._buckets.setdefault(key, []).append(slots.to(_SLOT))
        self._entries += slots.numel()

    def _protect(self, protected: torch.Tensor, on: bool) -> None:
        self._mask[protected] = on

    def smallest(self, count: int, protected: torch.Tensor) -> torch.Tensor:
        """Up to `count` current slots not in `protected` (sorted), smallest
        (key, slot) first: the victims a top-k over every slot would choose.
        Buckets are read from the smallest key; a bucket read is compacted
        into one segment of its current entries that were not taken."""
        out: list[torch.Tensor] = []
        need = count
        self._protect(protected, True)
        try:
            for key in sorted(self._buckets):
                if need <= 0:
                    break
                entries = self._live(key)
                protected_here = self._mask[entries]
                free = entries[~protected_here]
                if free.numel() > need:  # the lowest slots of the bucket: O(bucket), no sort of it
                    free = torch.topk(free, need, largest=False, sorted=False).values
                    self._taken[free] = True
                    rest = entries[~self._taken[entries]]
                    self._taken[free] = False
                else:  # every unprotected entry is taken
                    rest = entries[protected_here]
                out.append(free)
                need -= free.numel()
                self._entries -= sum(t.numel() for t in self._buckets[key]) - rest.numel()
                if rest.numel():
                    self._buckets[key] = [rest]
                else:
                    del self._buckets[key]
        finally:
            self._protect(protected, False)
        return torch.sort(torch.cat(out)).values.to(torch.int64) if out else _EMPTY

    def _first_copy(self, entries: torch.Tensor) -> torch.Tensor:
        """A mask keeping one entry per slot (a slot may be pushed twice with
        the same key: an LFU slot evicted, refilled and used as often again)."""
        position = torch.arange(entries.numel(), dtype=_SLOT)
        self._where[entries] = position  # of duplicates, one position wins
        first = self._where[entries] == position
        self._where[entries] = -1
        return first

    def min_key(self, protected: torch.Tensor) -> int | None:
        """The smallest key of a current slot not in `protected`: segments are
        read in order until one has such a slot (stale ones are dropped)."""
        self._protect(protected, True)
        try:
            for key in sorted(self._buckets):
                segments = self._buckets[key]
                found = False
                kept = []
                for i, seg in enumerate(segments):
                    live = seg[self.current(seg) == key]
                    self._entries -= seg.numel() - live.numel()
                    if live.numel():
                        kept.append(live)
                    if live.numel() and not bool(self._mask[live].all()):
                        kept.extend(segments[i + 1 :])
                        found = True
                        break
                if kept:
                    segments[:] = kept
                else:
                    del self._buckets[key]
                if found:
                    return key
            return None
        finally:
            self._protect(protected, False)
