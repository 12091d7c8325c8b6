"""SlotOrder, the cache's eviction order: the victims it gives are those a sort of
every current slot by (key, slot) gives, however the pushes, the evictions and
the sweeps of stale entries (compaction) interleave."""

from __future__ import annotations

import torch

from recsys_cli.embeddings.slot_order import SlotOrder


def reference_smallest(keys: torch.Tensor, count: int, protected: torch.Tensor) -> torch.Tensor:
    """The `count` current unprotected slots of smallest (key, slot), sorted by slot."""
    candidates = torch.nonzero(keys >= 0).flatten()
    candidates = candidates[~torch.isin(candidates, protected)]
    order = torch.argsort(keys[candidates] * keys.numel() + candidates)  # (key, slot) as one integer
    return torch.sort(candidates[order[:count]]).values


def buckets(order: SlotOrder) -> dict[int, list[int]]:
    return {k: sorted(torch.cat(v).tolist()) for k, v in order._buckets.items()}


def test_victims_match_a_sort_of_every_slot_through_pushes_evictions_and_compactions():
    capacity = 500
    gen = torch.Generator().manual_seed(0)
    for policy in ("lru", "lfu"):
        keys = torch.full((capacity,), -1, dtype=torch.int64)
        order = SlotOrder(capacity, lambda s: keys[s.long()], compact_at=2)
        compactions = 0
        compact = order.compact

        def counted():
            nonlocal compactions
            compactions += 1
            compact()

        order.compact = counted
        for clock in range(1, 300):
            touched = torch.unique(torch.randint(0, capacity, (60,), generator=gen))
            if policy == "lru":
                keys[touched] = clock
                order.push(touched, clock)
            else:  # use counts: a slot evicted (-1) starts again from 1
                keys[touched] = keys[touched].clamp(min=0) + 1
                order.push(touched, keys[touched])
            if clock % 7 == 0:
                protected = torch.unique(torch.randint(0, capacity, (40,), generator=gen))
                want = reference_smallest(keys, 50, protected)
                got = order.smallest(50, protected)
                assert torch.equal(got, want), (policy, clock)
                keys[got] = -1  # evicted: the slot is free
        assert compactions > 5, (policy, compactions)


def test_a_compaction_keeps_exactly_the_entries_a_rebuild_makes():
    capacity = 300
    gen = torch.Generator().manual_seed(1)
    keys = torch.full((capacity,), -1, dtype=torch.int64)
    order = SlotOrder(capacity, lambda s: keys[s.long()], compact_at=1000)  # never on its own
    for _ in range(200):
        touched = torch.unique(torch.randint(0, capacity, (40,), generator=gen))
        keys[touched] = keys[touched].clamp(min=0) + 1
        order.push(touched, keys[touched])
        order.push(touched[:3], keys[touched[:3]])  # the same slot twice under its key: one entry survives
        keys[torch.randint(0, capacity, (5,), generator=gen)] = -1  # evicted behind the order's back: stale
    assert order._entries > capacity
    order.compact()
    compacted, entries = buckets(order), order._entries
    order.rebuild()
    assert compacted == buckets(order) and entries == order._entries == int((keys >= 0).sum())
