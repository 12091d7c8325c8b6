"""What a batch's window protects from eviction, for every window width at once: the cache's room search.

CachedGroup.prepare (cache.py) asks, for batch j and each window w from the
widest down, which slots the batches j - w .. j - 1 and j's own hits hold,
and how many resident slots that leaves to evict. One WindowProtection
answers every w from a single merge of the window's history: a narrower
window is a prefix of the same ages, never a fresh union (issue 27 item 9).
It holds no cache state: the cache's history, slot map and scratch are
passed in, and the scratch is left as it was found.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

UNSET = torch.iinfo(torch.int32).max  # the scratch's value between calls (one int32 per cache slot)


class WindowProtection:
    """The slots of a batch's hits and of the batches in `history`, each with
    the latest batch that holds it (its hits: the batch itself). The slots a
    window starting at batch `first` protects are those held at or after
    `first`: as a set, torch.unique of the window's slots (in no particular
    order: they only mark slots in the victim search).

    Without a sort (a sort of the window's few thousand entries cost most of
    a prepare's room search): every entry's age = index - holder is
    min-scattered into `scratch` (one int32 per cache slot, UNSET between
    calls, reset here at the entries touched), and the entries that find
    their own age there hold their slot latest; of those, the first position
    per slot is kept by a second min-scatter over the few that remain. That
    is the entry with the least (age, position), as one scatter of the int64
    code (age << 32) | position chose before, at half the scratch (issue 27
    item 9; ages are below 2**31: at most the batches in the history).
    Resident slots are counted by age, so a window's count is a prefix sum."""

    def __init__(self, index: int, hits: torch.Tensor, history: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
                 row_of_slot: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        scratch = torch.full(row_of_slot.shape, UNSET, dtype=torch.int32) if scratch is None else scratch
        slots = torch.cat([hits, *(slots for _, slots, _ in history)])
        age = torch.cat([torch.zeros(hits.numel(), dtype=torch.int32),
                         *(torch.full((held.numel(),), index - batch, dtype=torch.int32) for batch, held, _ in history)])
        latest_at = self._least(scratch, slots, age)
        first = self._least(scratch, slots.index_select(0, latest_at), torch.arange(latest_at.numel(), dtype=torch.int32))
        latest_at = latest_at.index_select(0, first)
        self.index = index
        self.slots = slots.index_select(0, latest_at)
        age = age.index_select(0, latest_at).to(torch.int64)
        self.latest = index - age
        # resident_within[a]: resident slots whose latest holder is at most a batches old.
        oldest = history[0][0] if history else index
        self.resident_within = torch.bincount(age[row_of_slot[self.slots] >= 0], minlength=index - oldest + 1).cumsum(0)

    @staticmethod
    def _least(scratch: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Positions of the entries whose int32 value is the least of their
        slot's (ties: all of them), through `scratch`, left all UNSET again."""
        scratch.scatter_reduce_(0, slots, values, "amin")
        least = torch.nonzero(scratch.index_select(0, slots) == values).flatten()
        scratch.index_fill_(0, slots, UNSET)
        return least

    def slots_from(self, first: int) -> torch.Tensor:
        return self.slots[self.latest >= first]

    def resident_from(self, first: int) -> int:
        """How many of slots_from(first) hold a row."""
        age = self.index - first
        if age < 0:
            return 0
        return int(self.resident_within[min(age, self.resident_within.numel() - 1)])
