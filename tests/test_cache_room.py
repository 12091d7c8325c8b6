"""A cache's batch costs what the batch touches, not a pass over every slot (issue 15, item 5).

prepare() used to build capacity-sized masks to find room (which slots are
evictable, how many, the least used one, the victims' top-k) whenever free
slots ran out: for a 5 % cache of Criteo Kaggle, 1.7M slots a batch against a
few thousand rows. These tests watch every torch call of prepare() with a
TorchFunctionMode and count the results of at least a quarter of the slots
(in-place results, the cache's own tensors, excluded) in a cache whose
capacity is 50 times a batch. LRU caches never make one; an LFU cache merges
its least-used bucket once per eviction pass, which frees evict_chunk slots
(1/8 of the cache), so that pass is paid for by the slots it frees; a batch
that evicts nothing never makes one. The eviction order itself is checked
against a top-k over every slot.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from recsys_cli.embeddings.cache import CachedGroup
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.plan import plan_lookup
from recsys_cli.embeddings.store import RowStore
from recsys_cli.embeddings.table_init import TableSpec, build_initial_rows

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)

ROWS, SLOTS, BATCH = 200_000, 20_000, 400


class LargeResults(TorchFunctionMode):
    """Records every torch call whose result has at least `size` elements and
    is none of its inputs (an in-place op returns its input)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.calls: list[str] = []
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and isinstance(out, torch.Tensor) and out.numel() >= self.size:
            inputs = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
            if not any(a.data_ptr() == out.data_ptr() for a in inputs):
                self.calls.append(getattr(func, "__name__", str(func)))
        return out


def _group(policy: str, lookahead: bool, precision: str) -> CachedGroup:
    spec = TableSpec("t", ROWS, 4)
    optimizer = RowOptimizer("sgd", 0.1)
    store = RowStore(ROWS, 4, optimizer.initial_state(ROWS, torch.device("cpu")), precision)
    build_initial_rows([spec], 0, store.write_initial, into=store.initial_view)
    return CachedGroup(tables=[spec], feature_tables=["t"], store=store, optimizer=optimizer, device=torch.device("cpu"),
                       cache_slots=SLOTS, policy=policy, lookahead=lookahead, window=3, admit_all=precision == "fp32",
                       store_tier="host")


def _plan(values: torch.Tensor):
    return plan_lookup(values, torch.ones(values.numel(), dtype=torch.int64), torch.tensor([values.numel()]),
                       torch.zeros(1, dtype=torch.int64))


def _warm_up(group: CachedGroup) -> None:
    """Three passes over a hot set of exactly SLOTS rows: the cache is full,
    every resident row used three times."""
    for _ in range(3):
        for start in range(0, SLOTS, BATCH):
            plan = _plan(torch.arange(start, start + BATCH))
            group.prepare(plan)
            group.release(plan)
    assert group.num_free == 0


def _plans(count: int, seed: int = 0):
    """Batches of BATCH ids: half from the hot set (hits), half from the rest
    of the table (misses, each used about once: an LFU admission turns them away)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        hot = torch.randint(0, SLOTS, (BATCH // 2,), generator=gen)
        cold = torch.randint(SLOTS, ROWS, (BATCH // 2,), generator=gen)
        yield _plan(torch.cat([hot, cold]))


def _watch_index(group: CachedGroup, mode: LargeResults) -> None:
    """The row -> slot index rebuilds itself when removals pile up, and a
    victim order when stale entries pile up (beyond twice the slots), each
    amortised over as many removals or pushes: not the cache's room search,
    not counted here."""
    watched = [(getattr(group, "slot_index", None), ("lookup", "insert", "remove", "contains", "clear"))]
    watched += [(order, ("compact",)) for order in (group.victims, group.least_used) if order is not None]
    for index, names in watched:
        if index is None:
            continue
        for name in names:
            method = getattr(index, name, None)
            if method is None:
                continue

            def paused(*args, _method=method, **kwargs):
                mode.paused += 1
                try:
                    return _method(*args, **kwargs)
                finally:
                    mode.paused -= 1

            setattr(index, name, paused)


@pytest.mark.parametrize("policy,lookahead,precision", [
    ("lru", True, "fp32"),  # lookahead: the window shrinks to make room
    ("lru", False, "fp32"),
    ("lfu", True, "fp32"),
    ("lfu", False, "int8"),  # LFU admission: misses turned away, often with nothing evicted
    ("lru", False, "int8"),
])
def test_prepare_never_scans_every_slot(policy, lookahead, precision):
    group = _group(policy, lookahead, precision)
    _warm_up(group)
    mode = LargeResults(SLOTS // 4)
    _watch_index(group, mode)
    scanning, passes = 0, 0
    for plan in _plans(120):
        evicted = group.stats()["rows_evicted"]
        before = len(mode.calls)
        with mode:
            group.prepare(plan)
        group.release(plan)
        freed = group.stats()["rows_evicted"] - evicted
        passes += freed >= group.evict_chunk
        if len(mode.calls) > before:
            scanning += 1
            assert freed >= group.evict_chunk, f"a batch that freed {freed} slots made {mode.calls[before:]}"
    turned_away = group.stats()["not_admitted"] > 0
    assert group.stats()["rows_evicted"] > 0 or turned_away
    if policy == "lru":
        assert mode.calls == []
    else:
        assert scanning <= passes


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_victims_are_the_top_k_over_every_slot(policy):
    """The eviction order is (score, slot) over the evictable slots, as a top-k would choose."""
    group = _group(policy, False, "fp32")
    _warm_up(group)
    chosen = []
    original = group._evict

    def evict(at_least, protected, available, first):
        resident = group.row_of_slot >= 0
        evictable = resident & ~torch.isin(torch.arange(group.capacity), protected)
        assert available == int(evictable.sum())
        count = min(available, max(at_least, group.evict_chunk))
        key = torch.where(evictable, group.score * group.capacity + torch.arange(group.capacity),
                          torch.iinfo(torch.int64).max)
        chosen.append(torch.sort(torch.topk(key, count, largest=False).indices).values)
        before = group.row_of_slot.clone()
        leaving = original(at_least, protected, available, first)
        freed = torch.nonzero((before >= 0) & (group.row_of_slot < 0)).flatten()
        assert torch.equal(freed, chosen[-1])
        return leaving

    group._evict = evict
    for plan in _plans(60, seed=1):
        group.prepare(plan)
        group.release(plan)
    assert len(chosen) > 3


def test_protection_equals_the_union_of_each_window():
    """_Protection answers every window from one merge: the same slots (as a
    set) as torch.unique over the window's batches and the hits, and the same
    count of resident ones; its scratch is left as it found it."""
    from collections import deque

    from recsys_cli.embeddings.window_protection import UNSET as _UNSET
    from recsys_cli.embeddings.window_protection import WindowProtection as _Protection

    gen = torch.Generator().manual_seed(3)
    capacity, index = 500, 40
    history = deque((b, torch.randint(0, capacity, (60,), generator=gen), torch.zeros(0, dtype=torch.int64))
                    for b in range(24, index))
    hits = torch.randint(0, capacity, (30,), generator=gen)
    row_of_slot = torch.where(torch.rand(capacity, generator=gen) < 0.8, torch.arange(capacity), -1)
    scratch = torch.full((capacity,), _UNSET, dtype=torch.int32)  # the cache's own: int32 ages
    protection = _Protection(index, hits, history, row_of_slot, scratch)
    assert bool((scratch == _UNSET).all())
    for first in range(20, index + 1):  # first <= index: a batch always protects its hits
        union = torch.unique(torch.cat([hits, *(s for b, s, _ in history if b >= first)]))
        assert torch.equal(torch.sort(protection.slots_from(first)).values, union)
        assert protection.resident_from(first) == int((row_of_slot[union] >= 0).sum())


def test_shrinking_window_merges_the_history_once():
    """A full lookahead cache whose window must shrink from 16 to 4 merges its
    history once per prepare, not once per window tried (that was O(window^2)
    batches of work a step: 143 batches' slots through torch.unique here), and
    still picks the widest window with room."""
    rows, slots, batch = 20_000, 2_000, 400
    spec = TableSpec("t", rows, 4)
    optimizer = RowOptimizer("sgd", 0.1)
    store = RowStore(rows, 4, optimizer.initial_state(rows, torch.device("cpu")), "fp32")
    build_initial_rows([spec], 0, store.write_initial, into=store.initial_view)
    group = CachedGroup(tables=[spec], feature_tables=["t"], store=store, optimizer=optimizer,
                        device=torch.device("cpu"), cache_slots=slots, policy="lru", lookahead=True, window=16,
                        admit_all=True, store_tier="host")
    unique_calls = []

    class CountUnique(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("unique", "_unique2", "_unique"):
                unique_calls.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    windows = []
    for b in range(30):  # every batch all misses: 400 fresh rows
        plan = _plan(torch.arange(b * batch, (b + 1) * batch) % rows)
        unique_calls.clear()
        with CountUnique():
            group.prepare(plan)
        windows.append(group.last_window)
        group.release(plan)
        # the window's history and hits once (at most 17 batches), and the
        # slot index's removal of the evicted rows (at most a batch)
        assert sum(unique_calls) <= (16 + 1 + 1) * batch
    # capacity 2,000 = 5 batches: the window holds 4 earlier batches and this one
    assert windows[-10:] == [4] * 10


def test_the_placement_searchs_index_bytes_are_what_a_lookahead_cache_holds():
    """The placement search's host bytes per slot for a cache's index (placement_bytes.py)
    equal what a lookahead cache reports in memory(), so a new per-slot
    tensor (the room search's scratch) cannot leave the placements short."""
    from recsys_cli.embeddings.placement_bytes import cache_index_bytes

    group = _group("lru", lookahead=True, precision="fp32")
    index_bytes = [n for tier, what, n in group.memory() if what == "index"]
    assert index_bytes == [cache_index_bytes(SLOTS, group.num_rows)]


# Tensors whose size is fixed by the tables or the probe window, not the slots.
_NOT_PER_SLOT = {"feature_row_offset", "feature_row_offset_sorted", "feature_order", "_steps"}


def _held_index_bytes(group: CachedGroup) -> int:
    """Bytes of every index tensor the cache holds, found on the objects
    themselves (not through memory()): the group's own tensors but the
    cache's rows and state, the slot index's, the victim orders' and their
    entries' segments."""
    tensors = [t for name, t in vars(group).items()
               if isinstance(t, torch.Tensor) and name not in _NOT_PER_SLOT | {"cache_rows", "cache_state"}]
    for part in (group.slot_index, group.victims, group.least_used):
        if part is not None:
            tensors += [t for name, t in vars(part).items() if isinstance(t, torch.Tensor) and name not in _NOT_PER_SLOT]
            tensors += [seg for segments in getattr(part, "_buckets", {}).values() for seg in segments]
    # A view (the slot index's windows over its keys) holds no bytes of its own.
    return sum(t.numel() * t.element_size() for t in tensors if t._base is None)


@pytest.mark.parametrize("policy,lookahead,precision", [("lru", False, "int8"), ("lru", True, "fp32")])
def test_the_row_map_and_victim_order_cost_at_most_32_bytes_a_slot(policy, lookahead, precision):
    """The index cost about 85 bytes a slot, more than an fp32 cache row of
    dim 16 (issue 27): the row -> slot map (int32 keys and slots in 2 buckets
    a slot) and the victim order (int32 entries, its scratch), measured on
    their tensors at the most the order held while batches churned the cache.
    The whole index (item 9): the slot metadata beside them (row, score, free
    stack, the room search's scratch) cost 37 bytes a slot in int64s, 64 in
    all; in int32s (a slot's row as the slot index keys it) 17, about 44 in
    all. memory()'s index line is every index tensor the cache holds, the
    victim order included (it was left out)."""
    group = _group(policy, lookahead, precision)
    assert group.slot_index.keys.dtype == torch.int32  # 200,000 rows: keys fit int32
    _warm_up(group)
    order_peak = group.victims.nbytes()
    index_peak = 0
    for plan in _plans(120):
        group.prepare(plan)
        group.release(plan)
        order_peak = max(order_peak, group.victims.nbytes())
        held = _held_index_bytes(group)
        assert sum(n for _, what, n in group.memory() if what == "index") == held
        index_peak = max(index_peak, held)
    assert group.stats()["rows_evicted"] > 0
    per_slot = (group.slot_index.nbytes() + order_peak) / SLOTS
    assert group.slot_index.nbytes() == 16 * SLOTS
    assert per_slot <= 32, f"{per_slot:.1f} bytes a slot"
    assert index_peak / SLOTS <= 45, f"the whole index: {index_peak / SLOTS:.1f} bytes a slot"


def _small_group(policy: str = "lru") -> CachedGroup:
    spec = TableSpec("t", 3000, 4)
    optimizer = RowOptimizer("sgd", 0.1)
    store = RowStore(3000, 4, optimizer.initial_state(3000, torch.device("cpu")), "int8")
    build_initial_rows([spec], 0, store.write_initial, into=store.initial_view)
    return CachedGroup(tables=[spec], feature_tables=["t"], store=store, optimizer=optimizer, device=torch.device("cpu"),
                       cache_slots=300, policy=policy, lookahead=False, window=1, admit_all=True, store_tier="host",
                       evict_chunk=8)


def test_scores_past_int32_widen_and_evict_as_before():
    """int32 scores hold a clock below 2**31: past it they widen to int64 in
    place, so a cache whose clock starts just below 2**31 evicts exactly the
    slots of one whose clock starts at 0 (LRU compares scores only), and its
    snapshot restores the widened scores; an int64 snapshot (before issue 27
    item 9) restores the same cache as the int32 one it equals."""
    start = 2**31 - 5
    plain, shifted = _small_group(), _small_group()
    shifted.clock = start
    gen = torch.Generator().manual_seed(5)
    for _ in range(12):  # the clock passes 2**31 - 1 at the 5th
        ids = (torch.rand(120, generator=gen) ** 2 * 3000).long()
        a, b = _plan(ids), _plan(ids)
        plain.prepare(a)
        shifted.prepare(b)
        assert torch.equal(a.slots, b.slots)
        plain.release(a)
        shifted.release(b)
        assert torch.equal(plain.row_of_slot, shifted.row_of_slot)
    resident = plain.row_of_slot >= 0
    assert plain.score.dtype == torch.int32 and shifted.score.dtype == torch.int64
    assert torch.equal(shifted.score[resident], plain.score[resident].to(torch.int64) + start)
    assert plain.stats()["rows_evicted"] > 0
    restored = _small_group()
    assert restored.load_cache_snapshot(shifted.cache_snapshot(), shifted.prepared)
    assert restored.score.dtype == torch.int64 and torch.equal(restored.score, shifted.score)
    saved = plain.cache_snapshot()
    old_format = {**saved, **{k: saved[k].to(torch.int64) for k in ("row_of_slot", "score", "free_slots")}}
    restored = _small_group()
    assert restored.load_cache_snapshot(old_format, plain.prepared)
    for name in ("row_of_slot", "score", "free_slots", "dirty"):
        assert torch.equal(getattr(restored, name), getattr(plain, name)), name
    assert restored.row_of_slot.dtype == torch.int32


def test_prepare_seconds_count_the_prefetchers_work_and_not_its_wait_for_the_trainer():
    # The summary's "cache fill seconds" said how long prepare() took, waits included: a lookahead
    # prefetcher that mostly waits for the trainer's window read as if filling took the whole step.
    group = _group("lru", lookahead=True, precision="fp32")  # window 3
    plans = [_plan(torch.arange(i * BATCH, (i + 1) * BATCH)) for i in range(5)]
    for plan in plans[:4]:
        group.prepare(plan)  # batches 0..3: the fourth is 3 ahead of the trainer's completed 0
    before = dict(group.counters)
    trainer = threading.Timer(0.5, group.release, args=(plans[0],))  # the trainer completes batch 0 later
    start = time.perf_counter()
    trainer.start()
    group.prepare(plans[4])  # waits for batch 0: its window is batches 1..3
    took = time.perf_counter() - start
    trainer.join()
    waited = group.counters["prepare_wait_seconds"] - before["prepare_wait_seconds"]
    worked = group.counters["prepare_seconds"] - before["prepare_seconds"]
    assert took >= 0.5 and waited >= 0.45 and worked < 0.25
    assert waited + worked == pytest.approx(took, abs=0.05)
