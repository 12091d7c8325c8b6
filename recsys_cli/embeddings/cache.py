"""CachedGroup: host (or low-precision) tables behind an fp32 device cache.

(Over 450 lines on purpose: this module alone owns residency, so every
method that reads or changes the slot maps, pins, dirty bits, counters or
the lock is here, and nowhere else. What needs none of them lives apart:
the victim order (slot_order.py), the row -> slot index, the plans.)

The cache holds `capacity` fp32 rows (and their optimizer state) in slots on
the device. Its protocol, all that other modules call:
  prepare(plan) -> Fill   make a batch's rows resident and pin them (the
                          prefetcher's thread, or the trainer's for an
                          on-demand cache); the Fill record says which slots
                          and which rows it loaded
  apply(plan, fill, ...)  the same on a replica (cache_avg's follower ranks)
  gather / update         the step reads and updates the plan's rows
  release(plan)           unpin after the update (write-backs happen on
                          eviction, inside prepare)
  hold(RowHold), complete(count), RowsHeld, write_slots(..., dirty=True)
                          a strategy keeps rows resident beyond the window
                          (cache_avg: rows touched since the last cross-rank
                          average); the hold's state is the strategy's
  read / table_state / cache_snapshot / load_cache_snapshot
                          evaluation and checkpoints, changing nothing
The plan carries the cache's per-batch state in typed fields (slots,
slots_device, ready, served, batch_index, lookup_counts).

Invariant 1, one owner per row. A row is served (read and updated) either
by exactly one slot or by the store, never by both: while a row has a slot,
its store copy is stale and nothing reads or writes it there; a row leaves
its slot only through a write-back (dirty) or a drop (clean), after which the
store is its owner again. Admission:
  * fp32 store: every row a batch needs gets a slot (cDLRM); a lookahead
    cache shrinks its window to make room, and a batch that cannot fit even
    alone is CacheTooSmall.
  * low-precision store (Yang et al.): rows that find no slot are read and
    updated in the store, dequantized and requantized. An on-demand cache with
    lfu policy also turns rows away by use count (a miss is admitted only if
    used at least as often as the victim it would replace). A lookahead cache
    admits every miss it has room for, except a row that a batch still in its
    window is served from the store: that row stays in the store until the
    batch completes, so no later batch can train on a copy of it that the
    store's update makes stale (the bug of issue 11).
No row is ever in two slots, and a batch's rows keep their owner from its
prepare to its release.

Invariant 2, residency follows from the batches alone. The batch with index
j (global, counted over the run) is prepared with window w <= `window`: it
waits until every batch before j - w has been completed by the trainer, and
the rows of batches j - w .. j - 1 (what they got at prepare, recorded in
`history`) and its own hits are protected, and so are the store-served rows
of those batches from admission; every other resident row may be
evicted, by policy (lru: least recently prepared; lfu: fewest uses), ties
broken by slot. Whether batch j - w + 1 happens to be done already changes
nothing, so the slots, evictions, write-backs and their order are a function
of the batch sequence, never of the prefetch thread's timing. w starts at
`window` and shrinks only when the unprotected rows cannot make room: the
window shrinks (window_used) and, at w = 0 with still no room, the cache
cannot hold one batch: CacheTooSmall, naming the numbers. Write-backs are
keyed by the step of the batch that evicts (stochastic rounding, quant.py),
so even their bits are fixed. A strategy may install a `RowHold` (cache_avg,
train/strategies/cache_avg.py: rows touched since the last cross-rank
average): then batch j protects every batch from hold.first_held(j - w)
on, batches complete when the strategy calls complete(), and when only held
rows are left prepare raises RowsHeld having changed nothing, to be called
again once the hold lets them go. The room is
counted, never scanned: the protected slots of the window and the counters
give how many slots may be evicted, and the victims come from SlotOrder
(slot_order.py) in (score, slot) order, so a batch costs what it touches.

Invariant 3, checkpoints do not perturb. cache_snapshot() and table_state()
read a snapshot (the store as it is, and beside it the dirty rows quantized
as a "patch" for readers without this cache, plus the cache itself) and
change nothing: no write-back, no dirty bit, no random draw.
load_cache_snapshot() restores the cache exactly, so a resumed run continues
with the same slots and the same fp32 values as the uninterrupted one. The
store's own copy of a dirty row is stale and is never read (reads of
resident rows go to the cache, and the row's write-back replaces it); a
resume that restores the cache loads the table as saved, stale copies and
all, so its store equals the uninterrupted run's byte for byte; any other
reader (predict, evaluate, export, init_from, a resume into another cache)
puts the patch in.
Checkpoints are taken with no batch in flight (the trainer pauses the
prefetcher at checkpoint and evaluation steps).

Debug runs (RECSYS_DEBUG=1) check the invariants: victims unpinned and
unprotected, loaded rows not already resident, rows served by the store
without a slot, and, after every prepare, that slot and row maps agree.

Concurrency: the lookahead prefetcher calls prepare() on its own thread while
the trainer gathers, updates and releases; one lock guards the slot maps and
a condition variable wakes a prefetcher waiting for completed batches. The
lock is not held while prepare() reads and writes the store (a disk store's
I/O): it decides and reserves under the lock, moves rows to and from the
store without it, and publishes under it again (why that keeps one owner per
row: the comment in prepare). On
CUDA the fill copies run on a side stream from pinned staging buffers.
Ordering is by events, through the device runtime (device.py), so CPU tests
check it with a recording runtime: every reader of a slot waits for its fill
(gather on plan.ready, read() and snapshots on the last fill, recorded with
the lock held, when the slot map is published), and every load or write-back
of a slot waits for its last use on the compute stream: the release of the
last batch before the prepare's protected window (no batch from there on uses
the slot), and the last write_slots, which cache_avg's averages go through
(with cache_avg's hold, the newest use of any kind). Waiting for the newest
release instead made every evicting prepare wait for the GPU to finish the
step it was computing. The
step indexes device tensors only with index tensors built on the host in
prepare: a boolean mask on a CUDA tensor is a nonzero, a device sync.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

import torch

from recsys_cli.device import PinnedStaging, runtime_for
from recsys_cli.embeddings.plan import Fill, LookupPlan, RowSources
from recsys_cli.embeddings.quant import decode_saved
from recsys_cli.embeddings.slot_index import SlotIndex, key_dtype
from recsys_cli.embeddings.slot_order import SlotOrder
from recsys_cli.embeddings.tables import TableGroup
from recsys_cli.embeddings.window_protection import UNSET, WindowProtection
from recsys_cli.errors import UserError

if TYPE_CHECKING:
    from recsys_cli.embeddings.plan import Event
    from recsys_cli.embeddings.protocols import CachedGroupProtocol, RowHold

DEBUG = os.environ.get("RECSYS_DEBUG", "") not in ("", "0")
SNAPSHOT_STEP = -3  # rounding key of dirty rows quantized into a checkpoint's copy of a table


class CacheTooSmall(UserError):
    """The cache cannot hold the unique rows of one batch."""


class PrefetchStopped(RuntimeError):
    pass


class RowsHeld(Exception):
    """prepare() of batch `batch` found room only among rows the hold keeps
    (RowHold). Nothing was changed: prepare it again once
    hold.first_held(batch) reaches `batch`."""

    def __init__(self, batch: int) -> None:
        super().__init__(batch)
        self.batch = batch



def _weak(method):
    """`method` without a strong reference to its object: a SlotOrder holding
    the cache's bound method would put the cache, and the tables of its
    store, in a reference cycle that only the cyclic collector frees, which
    tensors' bytes never trigger (a process building trainers one after
    another, a sweep or a benchmark, ran out of memory)."""
    ref = weakref.WeakMethod(method)
    return lambda slots: ref()(slots)


_INT32_MAX = torch.iinfo(torch.int32).max


def cache_slots(num_rows: int, cache_rows: int | None, cache_ratio: float) -> int:
    slots = cache_rows if cache_rows is not None else int(round(num_rows * cache_ratio))
    return max(1, min(num_rows, slots))


class CachedGroup(TableGroup):
    def __init__(
        self, *args, cache_slots: int, policy: str = "lru", lookahead: bool = False, window: int = 1,
        admit_all: bool = True, store_tier: str = "host", evict_chunk: int | None = None, sizing: str = "",
        **kwargs,
    ) -> None:
        super().__init__(*args, store_tier=store_tier, **kwargs)
        self.sizing = sizing  # why the cache has cache_slots slots (cache_size.py), for start-up lines and errors
        self.kind = "lookahead" if lookahead else "cache"
        self.lookahead = lookahead
        # On-demand caches prepare on the trainer's thread, every earlier batch done.
        self.window = window if lookahead else 0
        self.policy = policy
        self.admit_all = admit_all
        self.capacity = cache_slots
        # Slots an eviction pass frees at least: each pass pays a room search over the window's
        # batches and a victim search, so freeing more a pass runs fewer of them. An eighth, not
        # a 32nd: a 1 % lookahead cache of Kaggle's tables at batch 16384 then fills a batch in
        # 22.7 ms, not 34.0 (bench/cache_fill_bench.py, 78 batches), for a hit rate of 0.661, not
        # 0.668; on a GPU that work, not the copies, can set lookahead's pace.
        self.evict_chunk = evict_chunk or max(1, cache_slots // 8)
        self.inflight = 0  # plans pinned and not yet released
        dev = self.device
        self.cache_rows = torch.zeros(cache_slots, self.dim, device=dev)
        self.cache_state = torch.zeros(cache_slots, self.store.state_width, device=dev)
        # row -> slot for resident rows only: a hash map sized to the cache, not the table.
        self.slot_index = SlotIndex(cache_slots, max_key=self.num_rows - 1)  # int32 keys below 2**31 rows
        # Per-slot metadata in the narrowest dtype that holds it (issue 27
        # item 9: it cost 37 bytes a slot, more than the row -> slot map):
        # a slot's row as the slot index keys it, int32 below 2**31 - 2 rows,
        # int64 for a fused group past that (its row ids need it); slots
        # (free stack, scratch) are int32, as a cache has < 2**29 slots
        # (SlotIndex's limit). Reads that leave the cache widen to int64 (_rows).
        self.row_of_slot = torch.full((cache_slots,), -1, dtype=key_dtype(self.num_rows - 1))
        self.pins: torch.Tensor | None = None  # debug runs only (the `debug` property)
        self.debug = DEBUG
        self.dirty = torch.zeros(cache_slots, dtype=torch.bool)
        # lru: the clock of the last use; lfu: uses. Both are at most the
        # clock, so int32 until the clock passes 2**31 - 1 (_tick widens it then).
        self.score = torch.zeros(cache_slots, dtype=torch.int32)
        self._protection_scratch = torch.full((cache_slots,), UNSET, dtype=torch.int32)  # WindowProtection's, between calls all UNSET
        # A stack of free slots: the top `num_free` entries.
        self.free_slots = torch.arange(cache_slots - 1, -1, -1, dtype=torch.int32)
        self.num_free = cache_slots
        # LFU admission needs a count for rows that are not resident (LRU
        # admits every miss it has room for).
        lfu_admission = not admit_all and not lookahead and policy == "lfu"
        self.row_uses = torch.zeros(self.num_rows, dtype=torch.int32) if lfu_admission else None
        # Resident slots in eviction order (score, slot), and for LFU admission
        # by their rows' uses: a batch finds room without a pass over every slot.
        # compact_at=2: stale entries at most the slots, so the order costs at most 14 bytes a slot (slot_order.py).
        self.victims = SlotOrder(cache_slots, _weak(self._score_of), compact_at=2)
        self.least_used = SlotOrder(cache_slots, _weak(self._uses_of)) if lfu_admission else None
        self.clock = 0
        self.prepared = 0  # index of the next batch prepare() takes
        self.completed = 0  # batches the trainer is done with
        # (batch, its slots, the rows the store served it): what later batches protect.
        self.history: collections.deque[tuple[int, torch.Tensor, torch.Tensor]] = collections.deque()
        self.row_hold: RowHold | None = None  # a strategy's (hold): then batches complete by complete()
        self.last_window = self.window
        self.moving = False  # a prepare() is reading or writing the store, lock released
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.counters = dict(hits=0, misses=0, rows_loaded=0, rows_evicted=0, rows_written_back=0,
                           bytes_to_device=0, bytes_to_host=0, not_admitted=0,
                           # prepare's own work, and apart its waits for the trainer (a window's
                           # batches completed, a write-back's copy off the device)
                           prepare_seconds=0.0, prepare_wait_seconds=0.0)
        self.use_runtime(runtime_for(dev), side_stream=dev.type == "cuda" and lookahead)

    @property
    def debug(self) -> bool:
        """Whether the invariants are asserted as the cache runs (RECSYS_DEBUG=1, or set by a test)."""
        return self.pins is not None

    @debug.setter
    def debug(self, on: bool) -> None:
        """Debug runs count each slot's pins (the plans in flight that hold
        it) to assert that no victim is pinned; nothing else reads them, so
        other runs keep no pins (4 bytes a slot, issue 27 item 9). The count
        starts at zero, so it is switched with no batch in flight."""
        if bool(on) == (self.pins is not None):
            return
        if self.inflight:
            raise RuntimeError("debug checks are switched on or off with no batch in flight")
        self.pins = torch.zeros(self.capacity, dtype=torch.int32) if on else None

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The int64 rows of `slots` (-1: none), for the store and other callers."""
        return self.row_of_slot[slots].to(torch.int64)

    def _tick(self) -> None:
        """Advance the clock. Scores are at most the clock (lru: a clock; lfu:
        at most one use a prepare), so past 2**31 - 1 they are widened to
        int64 in place: the same values, so the same order and victims."""
        self.clock += 1
        if self.clock > _INT32_MAX and self.score.dtype != torch.int64:
            self.score = self.score.to(torch.int64)

    def _score_of(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(self.row_of_slot[slots] >= 0, self.score[slots], -1)

    def _uses_of(self, slots: torch.Tensor) -> torch.Tensor:
        rows = self._rows(slots)
        return torch.where(rows >= 0, self.row_uses[rows.clamp(min=0)].to(torch.int64), -1)

    def use_runtime(self, runtime, side_stream: bool = True) -> None:
        """Streams, events and staging buffers from `runtime` (tests install a
        recording one); fills run on a side stream when side_stream is True."""
        self.runtime = runtime
        self.side_stream = runtime.new_stream() if side_stream else None
        self.last_use = None  # the compute stream's last read or write of slots
        # (batch, event recorded at its release), newest last: what a slot that no batch
        # from `first` on uses must wait for before a load or write-back (_last_uses)
        self.released: collections.deque[tuple[int, Event]] = collections.deque()
        self.free_after: tuple[int, Event] | None = None  # the latest release a free slot's last use precedes
        # the last read or write of slots outside any batch (write_slots: cache_avg's
        # averages; restores; evaluations' reads): every later load and write-back waits for it
        self.last_outside: Event | None = None
        self.last_fill = None  # the side stream's last fill
        # Host rows go to the device through pinned buffers: one pair for fills
        # (prefetch thread), one for rows the store serves in the step (trainer).
        staged = self.store.device.type == "cpu" and (side_stream or self.device.type != "cpu")
        cols = self.store.state_width
        self.fill_staging = (PinnedStaging(runtime, self.dim), PinnedStaging(runtime, cols)) if staged else None
        self.step_staging = (PinnedStaging(runtime, self.dim), PinnedStaging(runtime, cols)) if staged else None
        # and back (write-backs, prefetch thread): the copy is enqueued under the
        # lock, waited for after it (prepare), so release() never waits on the device
        self.back_staging = (PinnedStaging(runtime, self.dim), PinnedStaging(runtime, cols)) if staged else None
        # and the low-precision step's rows for the store (trainer)
        self.store_staging = (PinnedStaging(runtime, self.dim), PinnedStaging(runtime, cols)) if staged else None

    def _to_device(self, t: torch.Tensor, staging: PinnedStaging | None = None) -> torch.Tensor:
        """A host tensor on the device, through a pinned staging buffer if given (counted either way)."""
        if staging is None:
            return self.runtime.to_device(t, self.device)
        view = staging.take(t.shape[0])
        view.copy_(t)
        return staging.to_device(view, self.device)

    def _pinned_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor (slot or position indices) on the device: pinned first, so the copy is asynchronous."""
        if t.device.type != "cpu":  # already on a device: nothing to pin
            return t.to(self.device)
        return self._to_device(self.runtime.pin(t))

    def _to_store_device(self, ids: torch.Tensor) -> torch.Tensor:
        """Host row ids where the store is (a device-resident store: pinned, then copied)."""
        return ids if self.store.device.type == "cpu" else self._pinned_to_device(ids)

    def _record_fill(self) -> None:
        if self.side_stream is not None:
            self.last_fill = self.runtime.recorded(self.side_stream)

    def _wait_fills(self) -> None:
        """The current stream waits for every fill so far (readers outside a plan)."""
        if self.last_fill is not None:
            self.runtime.current_stream().wait_event(self.last_fill)

    def _used(self) -> Event | None:
        """The compute stream just read or wrote slots: later loads and write-backs wait for it."""
        if self.side_stream is None:
            return None
        used = self.runtime.recorded()
        self.last_use = used
        return used

    def _release_before(self, first: int) -> tuple[int, Event] | None:
        """(Lock held.) The newest release of a batch before `first`."""
        before = None
        for released in self.released:
            if released[0] >= first:
                break
            before = released
        return before

    def _last_uses(self, first: int, free: bool = False) -> list:
        """(Lock held.) The events a write-back of, or a load into, slots that no
        batch from `first` on uses waits for: the release of batch first - 1 (their
        rows' last step: batches before `first` are completed), the last use
        outside any batch (write_slots, a restore, an evaluation's read), and for slots freed by earlier prepares (`free`) the release
        their eviction waited for; not the newest release. A prefetcher a window
        ahead then never waits for the step the device is computing now (waiting
        for it made every evicting prepare wait for the GPU to drain). With a
        hold (cache_avg) rows outlive their batches: the newest use of any kind."""
        if self.row_hold is not None:
            return [self.last_use] if self.last_use is not None else []
        before = self._release_before(first)
        if free and self.free_after is not None and (before is None or self.free_after[0] > before[0]):
            before = self.free_after
        return [e for e in (before and before[1], self.last_outside) if e is not None]

    # --- filling -------------------------------------------------------------
    def prepare(self, plan: LookupPlan) -> "Fill":
        """Make the plan's rows resident and pin them (see the invariants
        above); returns what it did, for replicas on other ranks (apply)."""
        start, waited = time.perf_counter(), self.counters["prepare_wait_seconds"]
        unique = plan.unique
        if self.admit_all and unique.numel() > self.capacity:
            raise CacheTooSmall(
                f"a batch needs {unique.numel()} unique rows of {len(self.tables)} cached tables "
                f"but the cache has {self.capacity} slots ({self.sizing or 'placement.cache_rows'}): raise "
                f"placement.cache_rows / cache_ratio or lower trainer.batch_size"
            )
        with self.cond:
            index = self.prepared
            self._wait_completed(index - self.window)  # the prefetcher runs at most `window` batches ahead
            slots = self.slot_index.lookup(unique)
            hit = slots >= 0
            miss_at = torch.nonzero(~hit).flatten()  # positions, not masks: a batch indexes with them several times
            misses = unique.index_select(0, miss_at)
            if self.row_uses is not None:
                self.row_uses[unique] += 1
            need = misses.numel()
            protected, available = None, 0  # slots this batch may not evict, and how many it may
            if not self.admit_all:  # low precision: rows without a slot are served by the store
                self.last_window = self.window
                candidates = torch.nonzero(~torch.isin(misses, self._locked(index, self.window))).flatten()
                chosen = torch.ones(candidates.numel(), dtype=torch.bool)
                if candidates.numel() > self.num_free:  # not room for all in free slots: evict or turn away
                    protected, available = self._protected(self._protection(index, slots[hit]), index,
                                                           self.window)
                    if self.row_uses is not None:
                        chosen = self._admit(misses[candidates], protected, available)
                    room = self.num_free + available
                    chosen[torch.nonzero(chosen).flatten()[room:]] = False  # beyond the room: the store this step
                admitted = candidates[chosen]  # positions in misses, ascending
                need = admitted.numel()
            else:
                admitted = None  # every miss
                self.last_window = self.window
                if need > self.num_free:
                    self.last_window, protected, available = self._make_room(
                        index, slots[hit], need - self.num_free, unique)
            leaving = None  # evicted dirty rows: (copied event, rows, values, state) for the store
            first = self._first_unsafe(index - self.last_window)  # no batch from here on uses a victim
            if need > self.num_free:
                leaving = self._evict(need - self.num_free, protected, available, first)
            self.num_free -= need
            new_slots = self.free_slots[self.num_free : self.num_free + need].to(torch.int64)  # a copy
            arriving = misses if admitted is None else misses.index_select(0, admitted)
            if self.debug:
                assert not bool(self.slot_index.contains(arriving).any()), "loading a row that already has a slot"
            self.moving = True
        # The store's I/O (a disk store's reads and write-backs) runs without
        # the lock, so the trainer's release() and complete() never wait on
        # the disk. Safe by invariant 1: the rows moved here have no owner the
        # step can reach meanwhile. Leaving rows were unpinned and unprotected,
        # so no batch in flight uses them (in flight are only batches this
        # one protects, and cache_avg's rows awaiting an average are
        # protected too); arriving rows are in no batch in flight either (a
        # lookahead cache never admits a row the store serves to a protected
        # batch, and the others have no batch in flight), and their slots are
        # reserved: off the free stack, in no slot map, so nothing else takes,
        # reads or evicts them. The store copy of a leaving row is written
        # before any later prepare (this thread) can load it again. Readers
        # outside the step (read, snapshots, invalidate) wait until no prepare
        # is `moving` (_settled): to them a leaving row's only current value
        # is in flight to the store.
        try:
            if leaving is not None:
                copied, *leaving = leaving
                since = time.perf_counter()
                copied.synchronize()  # the write-back's copy off the device (enqueued under the lock)
                self.counters["prepare_wait_seconds"] += time.perf_counter() - since
                self.store.write(*leaving, index)
            values = self.store.read(self._to_store_device(arriving)) if arriving.numel() else None
        except BaseException:
            with self.cond:
                self.moving = False
                self.cond.notify_all()
            raise
        with self.cond:
            self._load(arriving, new_slots, values, first)
            self.moving = False
            self.cond.notify_all()
            loaded = miss_at if admitted is None else miss_at.index_select(0, admitted)
            slots.index_copy_(0, loaded, new_slots)  # the misses not admitted keep the lookup's -1
            if admitted is None:  # every row has a slot
                held, served_rows = slots, unique[:0]
            else:
                resident = slots >= 0
                held, served_rows = slots[resident], unique[~resident]
            if self.pins is not None:
                self.pins[held] += 1
            self._tick()
            if self.policy == "lru":
                self.score[held] = self.clock
                self.victims.push(held, self.clock)
            else:
                self.score[held] += 1
                self.victims.push(held, self.score[held])
            if self.least_used is not None:
                self.least_used.push(held, self.row_uses[unique[slots >= 0]].to(torch.int64))
            self.inflight += 1
            self.prepared += 1
            self.history.append((index, held, served_rows))  # tensors no one changes
            self._prune_history(index + 1 - self.window)
            while len(self.released) > 1 and self.released[1][0] < index + 1 - self.window:
                self.released.popleft()  # a later prepare's `first` is at least index + 1 - window
            n_hit = unique.numel() - misses.numel()
            # Counted when the batch is released, not here: the prefetcher runs
            # ahead by however far thread timing lets it, and metrics.jsonl's
            # hit rate must be a function of the batches trained.
            plan.lookup_counts = (n_hit, unique.numel() - n_hit, misses.numel() - need)
            if self.debug:
                self.check_ownership()
        plan.slots = slots
        plan.batch_index = index
        with self._stream():  # after this batch's fills, on the same stream
            plan.slots_device = self._pinned_to_device(slots)
            # A low-precision plan whose rows all have slots takes the fp32 path: the
            # split one waits for the device every step to write the store-served rows.
            if served_rows.numel():
                plan.served = self._served(plan.unique, slots)
            if self.side_stream is not None:
                plan.ready = self.runtime.recorded(self.side_stream)
        self.counters["prepare_seconds"] += time.perf_counter() - start - (self.counters["prepare_wait_seconds"] - waited)
        return Fill(slots, loaded)

    def loaded_values(self, plan: LookupPlan, fill: "Fill") -> torch.Tensor:
        """fp32 [k, row_width] host copies of the rows `fill` loaded and their
        optimizer state, once the fill's copies have landed."""
        if plan.ready is not None:
            plan.ready.synchronize()
        dev = self._pinned_to_device(fill.slots[fill.loaded])
        values = torch.cat([self.cache_rows.index_select(0, dev), self.cache_state.index_select(0, dev)], 1)
        return self._host_copy(values)  # broadcast at once: synchronous

    def apply(self, plan: LookupPlan, fill: "Fill", values: torch.Tensor | None) -> None:
        """A replica of another rank's cache (cache_avg, follower ranks): put
        the rows that rank loaded (`values`, as loaded_values gave them) into
        the same slots and pin the plan's slots as its prepare did. Followers
        never evict or write back (their store is not read while training), so
        a slot's old row, or a row's old slot, is simply forgotten."""
        slots = fill.slots
        n_load = fill.loaded.numel()
        with self.cond:
            if n_load:
                target = slots[fill.loaded]
                rows = plan.unique[fill.loaded]
                previous = self.slot_index.lookup(rows)
                self.row_of_slot[previous[previous >= 0]] = -1
                old = self._rows(target)
                self.slot_index.remove(torch.cat([rows[previous >= 0], old[old >= 0]]))
                dev = self._pinned_to_device(target)
                values = self._pinned_to_device(values)
                self.cache_rows.index_copy_(0, dev, values[:, : self.dim])
                self.cache_state.index_copy_(0, dev, values[:, self.dim :])
                self.row_of_slot[target] = rows.to(self.row_of_slot.dtype)
                self.slot_index.insert(rows, target)
                self.counters["rows_loaded"] += n_load
            if self.pins is not None:
                self.pins[slots] += 1
            self.inflight += 1
            plan.lookup_counts = (slots.numel() - n_load, n_load, 0)
        plan.slots = slots
        plan.slots_device = self._pinned_to_device(slots)

    @property
    def row_width(self) -> int:
        """fp32 values a slot holds: the row and its optimizer state."""
        return self.dim + self.cache_state.shape[1]

    def _served(self, unique: torch.Tensor, slots: torch.Tensor) -> RowSources:
        """Where a low-precision plan's rows come from, as index tensors built
        here on the host: no boolean mask ever indexes a device tensor."""
        resident = slots >= 0
        cached_at = torch.nonzero(resident).flatten()
        direct_at = torch.nonzero(~resident).flatten()
        move = self._pinned_to_device
        return RowSources(cached_at=move(cached_at), cached_slots=move(slots[cached_at]), cached_slots_host=slots[cached_at],
                      direct_at=move(direct_at), direct_rows=self._to_store_device(unique[direct_at]))

    def _settled(self) -> None:
        """Wait (lock held) until no prepare() is between its locked phases,
        so every row has its owner (a slot or the store) with its current value."""
        while self.moving:
            self.cond.wait(timeout=0.1)

    def _wait_completed(self, count: int) -> None:
        """Wait (lock held) until the trainer has completed `count` batches."""
        if self.completed >= count:
            return
        since = time.perf_counter()
        try:
            while self.completed < count:
                if self.stop.is_set():
                    raise PrefetchStopped()
                self.cond.wait(timeout=0.1)
        finally:
            self.counters["prepare_wait_seconds"] += time.perf_counter() - since

    def _first_unsafe(self, position: int) -> int:
        """The first batch whose rows may not be evicted yet once the trainer
        has completed `position` batches: `position` itself, or with
        with a hold the first batch it holds."""
        return position if self.row_hold is None else self.row_hold.first_held(position)

    def _protection(self, index: int, hits: torch.Tensor) -> WindowProtection:
        """What batch `index` may not evict, for every window at once."""
        return WindowProtection(index, hits, self.history, self.row_of_slot, self._protection_scratch)

    def _protected(self, protection: WindowProtection, index: int, window: int) -> tuple[torch.Tensor, int]:
        """(slots batch `index`, prepared with `window`, may not evict: those
        of the protected batches and its own hits, in no particular order; how many resident
        slots it may evict), from the batches in the window and the counters,
        never a pass over every slot."""
        first = self._first_unsafe(index - window)
        return protection.slots_from(first), self.capacity - self.num_free - protection.resident_from(first)

    def _locked(self, index: int, window: int) -> torch.Tensor:
        """Rows batch `index` must not admit: the store serves them to a protected batch."""
        first = self._first_unsafe(index - window)
        locked = [rows for batch, _, rows in self.history if batch >= first]
        return torch.cat(locked) if locked else torch.zeros(0, dtype=torch.int64)

    def _make_room(self, index: int, hits: torch.Tensor, extra: int, unique: torch.Tensor):
        """(window, protected slots, evictable count) for batch `index` that needs
        `extra` slots beyond the free ones: the widest window whose unprotected rows suffice."""
        # One pass over the window's history, then each narrower window is a
        # binary search: a fresh union per window made a full cache cost
        # O(window^2) batches of work per prepare (88 ms/step at window 32).
        # Waiting changes neither the history nor residency (only prepare, on
        # this thread, does); a hold may let rows go, so `first` is
        # read after each wait.
        protection = self._protection(index, hits)
        for window in range(self.window, -1, -1):
            self._wait_completed(index - window)
            protected, available = self._protected(protection, index, window)
            if available >= extra:
                return window, protected, available
        if self.row_hold is not None and self._first_unsafe(index) < index:
            # Only held rows are left (the trainer has completed every earlier
            # batch): the caller asks the holder to let some go.
            raise RowsHeld(index)
        raise CacheTooSmall(
            f"the cache of {self.capacity} slots cannot hold a batch's {unique.numel()} unique rows: raise "
            "placement.cache_rows / cache_ratio or lower trainer.batch_size"
        )

    def interrupt_waits(self) -> None:
        """A prepare() waiting for the trainer raises PrefetchStopped now, and
        any later one at once, until allow_waits() (the prefetcher is closing)."""
        self.stop.set()
        with self.cond:
            self.cond.notify_all()

    def allow_waits(self) -> None:
        self.stop.clear()

    def _prune_history(self, next_position: int) -> None:
        """Forget batches no later prepare can protect."""
        first = self._first_unsafe(next_position)
        while self.history and self.history[0][0] < first:
            self.history.popleft()
        if self.row_hold is not None:
            self.row_hold.forget_before(first)

    def _admit(self, misses: torch.Tensor, protected: torch.Tensor, available: int) -> torch.Tensor:
        """LFU admission for rows that may stay in low precision: free slots
        go to the most used misses; beyond them a miss must be used at least
        as often as the least used evictable row."""
        if self.num_free >= misses.numel():
            return torch.ones(misses.numel(), dtype=torch.bool)
        uses = self.row_uses[misses]
        least = self.least_used.min_key(protected) if available else None
        if least is not None:
            admitted = uses >= least
        else:
            admitted = torch.zeros(misses.numel(), dtype=torch.bool)
        admitted[torch.argsort(uses, descending=True, stable=True)[: self.num_free]] = True
        return admitted

    def _evict(self, at_least: int, protected: torch.Tensor, available: int, first: int):
        """Free at least `at_least` of the `available` unprotected resident
        slots (a chunk, to amortise the search), by policy, ties broken by slot;
        returns the dirty ones' write-back for the store (_write_back)."""
        count = min(available, max(at_least, self.evict_chunk))
        victims = torch.sort(self.victims.smallest(count, protected)).values
        if self.debug:
            assert victims.numel() == count, "the victim order lost slots"
            assert self.pins is not None and bool((self.pins[victims] == 0).all()), "evicting a slot a batch in flight holds"
        leaving = self._write_back(victims[self.dirty[victims]], first)
        freed = self._release_before(first)  # the victims' last step: loads into them wait for it
        if freed is not None and (self.free_after is None or freed[0] > self.free_after[0]):
            self.free_after = freed
        self.slot_index.remove(self.row_of_slot[victims], distinct=True)  # one row a slot
        self.row_of_slot[victims] = -1
        self.score[victims] = 0
        self.free_slots[self.num_free : self.num_free + count] = victims
        self.num_free += count
        self.counters["rows_evicted"] += count
        return leaving

    def _stream(self):
        return self.runtime.use_stream(self.side_stream) if self.side_stream is not None else contextlib.nullcontext()

    def _write_back(self, slots: torch.Tensor, first: int):
        """(copied, rows, values, state) of dirty `slots`, or None: their copy
        off the device is enqueued here (under the lock, without waiting for
        it); prepare() waits for the event `copied` after releasing the lock,
        then calls store.write."""
        if slots.numel() == 0:
            return None
        staging = self.back_staging or (None, None)
        with self._stream():
            for used in self._last_uses(first) if self.side_stream is not None else ():
                self.side_stream.wait_event(used)  # after the last write of these slots (updates, averages)
            dev_slots = self._pinned_to_device(slots)
            rows = self._off_device(self.cache_rows.index_select(0, dev_slots), staging[0])
            state = self._off_device(self.cache_state.index_select(0, dev_slots), staging[1])
            copied = self.runtime.recorded()
        self.dirty[slots] = False
        self.counters["rows_written_back"] += slots.numel()
        if self.store_tier == "host":
            self.counters["bytes_to_host"] += rows.numel() * 4 + state.numel() * 4
        return copied, self._to_store_device(self._rows(slots)), rows, state

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the host (as it is on CPU; a synchronous, counted copy from a device)."""
        return t if t.device.type == "cpu" else self.runtime.to_host(t)

    def _off_device(self, t: torch.Tensor, staging: PinnedStaging | None) -> torch.Tensor:
        """A cache tensor where the store is: a host store's through a pinned
        buffer (asynchronous), a device store's (or on CPU) as it is."""
        if staging is not None:
            return staging.from_device(t)
        if self.store.device == self.device:
            return t
        return self.runtime.to_host(t)

    def _load(self, rows: torch.Tensor, slots: torch.Tensor, read, first: int) -> None:
        """Put `rows` (their store values and state, `read`) into reserved `slots` and publish them."""
        if rows.numel() == 0:
            return
        values, state = read
        staging = self.fill_staging or (None, None)
        # The range names the fill copies in a profiler trace (bench/gpu_check.py's overlap stage).
        with torch.profiler.record_function("lookahead_fill"), self._stream():
            for used in self._last_uses(first, free=True) if self.side_stream is not None else ():
                self.side_stream.wait_event(used)  # the slots' previous rows are no longer read
            dev_slots = self._pinned_to_device(slots)
            self.cache_rows.index_copy_(0, dev_slots, self._to_device(values, staging[0]))
            self.cache_state.index_copy_(0, dev_slots, self._to_device(state, staging[1]))
            self._record_fill()  # before the slot map below makes the rows readable
        self.slot_index.insert(rows, slots)
        self.row_of_slot[slots] = rows.to(self.row_of_slot.dtype)  # int32 below 2**31 - 2 rows (key_dtype)
        self.dirty[slots] = False
        self.counters["rows_loaded"] += rows.numel()
        if self.store_tier == "host":
            self.counters["bytes_to_device"] += values.numel() * 4 + state.numel() * 4

    # --- the step --------------------------------------------------------------
    def _served_of(self, plan: LookupPlan) -> "RowSources | None":
        """Where the plan's rows are served from, or None when all are cached."""
        if plan.slots is None:
            raise RuntimeError("a cached group's plan was not prepared")
        return plan.served

    def gather(self, plan: LookupPlan) -> torch.Tensor:
        slots_dev = plan.slots_device
        served = self._served_of(plan)
        if plan.ready is not None:
            compute = self.runtime.current_stream()
            compute.wait_event(plan.ready)
            # Made on the side stream, used on this one: the allocator must not reuse them early.
            for t in (slots_dev,) if served is None else (slots_dev, served.cached_at, served.cached_slots, served.direct_at):
                self.runtime.record_stream(t, compute)
        if served is None:
            return self.cache_rows.index_select(0, slots_dev)
        staging = self.step_staging or (None, None)
        rows = torch.empty(plan.num_unique, self.dim, device=self.device)
        rows.index_copy_(0, served.cached_at, self.cache_rows.index_select(0, served.cached_slots))
        rows.index_copy_(0, served.direct_at, self._to_device(self.store.read_rows(served.direct_rows), staging[0]))
        return rows

    def update(self, plan: LookupPlan, rows: torch.Tensor, grad: torch.Tensor) -> None:
        slots_dev = plan.slots_device
        served = self._served_of(plan)
        if served is None:
            state = self.cache_state.index_select(0, slots_dev)
            rows, state = self.optimizer.step(rows, state, grad)
            self.cache_rows.index_copy_(0, slots_dev, rows)
            self.cache_state.index_copy_(0, slots_dev, state)
            self.dirty[plan.slots] = True
            return
        direct = served.direct_rows
        if self.debug:
            assert not bool(self.slot_index.contains(direct.cpu()).any()), "a row served by the store has a slot"
        staging = self.step_staging or (None, None)
        state = torch.empty(plan.num_unique, self.cache_state.shape[1], device=self.device)
        state.index_copy_(0, served.cached_at, self.cache_state.index_select(0, served.cached_slots))
        state.index_copy_(0, served.direct_at, self._to_device(self.store.read_state(direct), staging[1]))
        rows, state = self.optimizer.step(rows, state, grad)
        self.cache_rows.index_copy_(0, served.cached_slots, rows.index_select(0, served.cached_at))
        self.cache_state.index_copy_(0, served.cached_slots, state.index_select(0, served.cached_at))
        self.dirty[served.cached_slots_host] = True
        staging = self.store_staging or (None, None)
        direct_rows = self._off_device(rows.index_select(0, served.direct_at), staging[0])
        direct_state = self._off_device(state.index_select(0, served.direct_at), staging[1])
        if self.store_staging is not None:  # the host store is written from the pinned copies once they land
            copied = self.runtime.recorded()
            copied.synchronize()
        self.store.write(direct, direct_rows, direct_state, plan.batch_index)

    def write_slots(self, slots: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, dirty: bool = False) -> None:
        """Overwrite cached rows on the current stream; a later write-back or
        load of these slots waits for this write. dirty: the new values must
        reach the store (cache_avg's averages: mark them before the hold lets
        the rows go, or an eviction could drop them)."""
        dev = self._pinned_to_device(slots)
        self.cache_rows.index_copy_(0, dev, rows)
        self.cache_state.index_copy_(0, dev, state)
        self.last_outside = self._used()
        if dirty:
            with self.cond:
                self.dirty[slots] = True

    # --- a strategy's hold: rows kept beyond the window ------------------------------
    def hold(self, row_hold: RowHold) -> None:
        """From now on `row_hold` says which rows stay resident beyond the
        window (prepare raises RowsHeld when only those could make room), and
        a batch completes when the strategy says so (complete), not at release."""
        with self.cond:
            self.row_hold = row_hold

    def read_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 [k, row_width] on the device: the rows of `slots` and their optimizer state."""
        dev = self._pinned_to_device(slots)
        return torch.cat([self.cache_rows.index_select(0, dev), self.cache_state.index_select(0, dev)], 1)

    def release(self, plan: LookupPlan) -> None:
        if plan.slots is None:
            return
        used = self._used()  # every read and write of the plan's slots is enqueued before this
        with self.cond:
            if used is not None and plan.batch_index is not None:
                self.released.append((plan.batch_index, used))
            if self.pins is not None:
                self.pins[plan.slots[plan.slots >= 0]] -= 1
            self.inflight -= 1
            hits, misses, not_admitted = plan.lookup_counts or (0, 0, 0)
            plan.lookup_counts = None
            self.counters["hits"] += hits
            self.counters["misses"] += misses
            self.counters["not_admitted"] += not_admitted
            if self.row_hold is None:
                self.completed += 1
            self.cond.notify_all()
        plan.slots = None

    def complete(self, count: int) -> None:
        """With a hold: the trainer has completed `count` batches (cache_avg: their step's average included)."""
        with self.cond:
            self.completed = count
            self._prune_history(count + 1 - self.window)  # also on ranks that never prepare
            self.cond.notify_all()

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Current rows: resident ones from their slots (the owner, invariant
        1: a dirty row's store copy is stale), once their fills have landed
        (the prefetcher may still be filling); only the others from the
        store, so a disk store reads just the misses."""
        return self._read(ids, as_saved=False)

    def read_as_saved(self, ids: torch.Tensor) -> torch.Tensor:
        """read(), a low-precision cache's dirty rows rounded into the table's
        precision as a checkpoint rounds them (_as_saved): what an evaluation scores."""
        return self._read(ids, as_saved=self.store.precision != "fp32")

    def _read(self, ids: torch.Tensor, as_saved: bool) -> torch.Tensor:
        with self.cond:
            self._settled()
            slots = self.slot_index.lookup(ids)
            hit_at = torch.nonzero(slots >= 0).flatten()  # host index tensors: no mask on a device tensor
            miss_at = torch.nonzero(slots < 0).flatten()
            rows = torch.empty(ids.numel(), self.dim, device=self.device)
            if miss_at.numel():
                from_store = self._to_device(self.store.read_rows(self._to_store_device(ids[miss_at.to(ids.device)])),
                                             self.step_staging and self.step_staging[0])  # the trainer's: pinned
                rows.index_copy_(0, self._pinned_to_device(miss_at), from_store)
            if hit_at.numel():
                self._wait_fills()
                cached = self.cache_rows.index_select(0, self._pinned_to_device(slots[hit_at]))
                if as_saved:
                    cached = self._as_saved(ids[hit_at.to(ids.device)], slots[hit_at], cached)
                rows.index_copy_(0, self._pinned_to_device(hit_at), cached)
                # A fill after this read must not overwrite these slots before the read has run,
                # however late the device runs the evaluation that asked for it.
                self.last_outside = self._used()
            return rows

    def _as_saved(self, ids: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(Lock held.) fp32 `values` of the resident rows `ids` (in `slots`) as a
        checkpoint of this moment saves them: the dirty ones rounded into the
        table's precision as _snapshot_patch rounds them, the others as their
        store copy already decodes. An evaluation then scores the model the run
        saves, so `recsys evaluate` on its checkpoint gives the run's figures."""
        dirty_at = torch.nonzero(self.dirty[slots]).flatten()
        if dirty_at.numel() == 0:
            return values
        staging = self.step_staging and self.step_staging[0]  # the trainer's: evaluations run on its thread
        on_host = self._off_device(values.index_select(0, self._pinned_to_device(dirty_at)), staging)
        if staging is not None:  # an asynchronous copy into the pinned buffer: wait for it before reading
            self.runtime.recorded().synchronize()
        encoded = self.store.encode(self._to_store_device(ids[dirty_at.to(ids.device)]), on_host, SNAPSHOT_STEP)
        rounded = decode_saved({"precision": self.store.precision, **encoded}, self.dim)
        values.index_copy_(0, self._pinned_to_device(dirty_at), self._to_device(rounded, staging))
        return values

    # --- whole tables ------------------------------------------------------------
    def table_state(self, patch_beside: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """The store's tables with every dirty resident row quantized into the
        copy (a snapshot: the live cache, store and dirty bits do not change)."""
        with self.cond:
            self._settled()
            return super().table_state(patch_beside)

    def _snapshot_patch(self, lo: int, hi: int):
        with self.cond:  # a disk store asks when its checkpoint writes the table
            self._settled()
            slots = torch.nonzero(self.dirty).flatten()
            rows = self._rows(slots)
            inside = (rows >= lo) & (rows < hi)
            slots, rows = slots[inside], rows[inside]
            if rows.numel() == 0:
                return None
            dev_slots = self._pinned_to_device(slots)
            self._wait_fills()
            values = self._off_device(self.cache_rows.index_select(0, dev_slots), None)
            encoded = self.store.encode(self._to_store_device(rows), values, SNAPSHOT_STEP)
            return rows - lo, encoded, self._off_device(self.cache_state.index_select(0, dev_slots), None)

    def cache_snapshot(self) -> dict:
        """Everything that makes the cache what it is, for a checkpoint: with
        table_state(), load_cache_snapshot() restores exactly this cache and store.

        The cache's own tensors come as they are, not cloned (on CUDA, .cpu()
        copies them to the host): a clone would cost a second cache in host
        memory at every checkpoint (500 MB at issue 17's scale). So the
        snapshot is only valid until the cache next changes; a checkpoint
        writes it at once (the save is synchronous, and the prefetcher waits
        at checkpoint steps)."""
        with self.cond:
            self._settled()
            if self.inflight:
                raise RuntimeError("a cache snapshot needs every prepared batch released")
            self._wait_fills()
            return {
                **self.identity(),
                "cache_rows": self._host_copy(self.cache_rows), "cache_state": self._host_copy(self.cache_state),
                "row_of_slot": self.row_of_slot, "dirty": self.dirty, "score": self.score,
                "free_slots": self.free_slots, "num_free": self.num_free, "clock": self.clock,
                "prepared": self.prepared, "completed": self.completed,
                "history": list(self.history),  # tensors no one changes: prepare appends new ones
                "row_uses": self.row_uses,
                "stats": dict(self.counters),
            }

    def identity(self) -> dict:
        """What a snapshot must match to restore this cache (and a strategy's state of it)."""
        return {"kind": self.kind, "capacity": self.capacity, "precision": self.store.precision,
                "tables": [(t.name, t.num_rows) for t in self.tables]}

    def same_cache(self, saved: dict) -> bool:
        """Whether `saved` (a snapshot, or a strategy's state with these keys) is of this cache."""
        return all(saved.get(k) == v for k, v in self.identity().items())

    def restores_cache(self, saved: dict | None) -> bool:
        return saved is not None and self.same_cache(saved)

    def load_cache_snapshot(self, saved: dict | None, step: int) -> bool:
        """Restore what cache_snapshot() saved (after load_table_state). False
        when it came from another cache (other size, kind or tables): then the
        cache starts empty at batch `step`."""
        same = self.restores_cache(saved)
        with self.cond:
            self.invalidate()
            self.prepared = self.completed = step
            if self.row_hold is not None:
                self.row_hold.restart(step)
            if not same:
                return False
            self.cache_rows.copy_(saved["cache_rows"])
            self.cache_state.copy_(saved["cache_state"])
            self.row_of_slot.copy_(saved["row_of_slot"])
            resident = torch.nonzero(self.row_of_slot >= 0).flatten()
            self.slot_index.insert(self.row_of_slot[resident], resident)
            self.dirty.copy_(saved["dirty"])
            if saved["clock"] > _INT32_MAX:  # scores past int32, as _tick widened them in the saved run
                self.score = self.score.to(torch.int64)
            self.score.copy_(saved["score"])  # a checkpoint's int64 (before issue 27 item 9) or int32: the same values
            self.free_slots.copy_(saved["free_slots"])
            self.num_free, self.clock = saved["num_free"], saved["clock"]
            self.prepared, self.completed = saved["prepared"], saved["completed"]
            self.history = collections.deque((b, s.clone(), r.clone()) for b, s, r in saved["history"])
            if self.row_uses is not None and saved["row_uses"] is not None:
                self.row_uses.copy_(saved["row_uses"])
            for order in (self.victims, self.least_used):
                if order is not None:
                    order.rebuild(resident)
            self.counters.update(saved["stats"])
            self.last_outside = self._used()  # the restored rows: loads and write-backs come after
            if self.debug:
                self.check_ownership()
            return True

    def invalidate(self) -> None:
        """Forget every cached row (the store was overwritten)."""
        with self.cond:
            self._settled()
            if self.inflight:
                raise RuntimeError("cannot reload tables while batches are in flight")
            self.slot_index.clear()
            self.row_of_slot.fill_(-1)
            self.dirty.zero_()
            self.score.zero_()
            self.free_slots = torch.arange(self.capacity - 1, -1, -1, dtype=torch.int32)
            self.num_free = self.capacity
            self.clock = 0
            self.victims.clear()
            if self.least_used is not None:
                self.least_used.clear()
            self.history.clear()
            # Batch numbers may restart (a restore): every earlier use, one event.
            self.released.clear()
            self.free_after = None
            self.last_outside = self._used()
            if self.row_hold is not None:
                self.row_hold.restart(self.completed)

    def check_ownership(self) -> None:
        """Invariant 1 over the whole cache (debug runs, tests): the slot and
        row maps are inverse, no row has two slots, free slots hold no row."""
        with self.cond:
            self._settled()
            resident = torch.nonzero(self.row_of_slot >= 0).flatten()
            rows = self.row_of_slot[resident]
            assert torch.equal(self.slot_index.lookup(rows), resident), "slot and row maps disagree"
            assert len(self.slot_index) == resident.numel(), "a row maps to a slot that does not hold it"
            free = self.free_slots[: self.num_free]
            assert bool((self.row_of_slot[free] < 0).all()), "a free slot holds a row"
            assert free.numel() + resident.numel() == self.capacity, "slots lost"

    def memory(self) -> list[tuple[str, str, int]]:
        cache = [("device", "cache", t.numel() * t.element_size()) for t in (self.cache_rows, self.cache_state)]
        # Every index tensor this cache holds now: the victim orders' entries
        # and scratch too (their entries vary: none when the cache is built).
        index = [self.row_of_slot, self.dirty, self.score, self.free_slots, self._protection_scratch]
        index += [t for t in (self.pins, self.row_uses) if t is not None]
        orders = sum(order.nbytes() for order in (self.victims, self.least_used) if order is not None)
        index_bytes = self.slot_index.nbytes() + orders + sum(t.numel() * t.element_size() for t in index)
        return [*self.store.memory(self.store_tier), *cache, ("host", "index", index_bytes)]

    def stats(self) -> dict:
        s = {**self.counters, **self.store.stats()}
        s["cache_slots"] = self.capacity
        total = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / total if total else None
        return s


if TYPE_CHECKING:  # mypy: a CachedGroup is what protocols.CachedGroupProtocol promises its callers

    def _is_a_cached_group(group: CachedGroup) -> CachedGroupProtocol:
        return group
