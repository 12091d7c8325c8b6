"""CachedGroup: host (or low-precision) tables behind an fp32 device cache.

The cache holds `capacity` fp32 rows (and their optimizer state) in slots on
the device. Every resident row has exactly one owner, its slot: the store's
copy is stale until the row is written back, and the store never serves a
resident row. prepare(plan) makes every row of a batch resident and pins it;
release(plan) unpins it after the trainer's update. Only unpinned rows are
evicted, so a row that a batch inside the lookahead window needs stays put,
and a row's value always reflects every update before it: cached training
follows the same trajectory as training on the device, bit for bit.

Victims: free slots first, then unpinned slots by policy (lru: least recently
pinned; lfu: fewest uses since admission). Eviction runs in chunks of
`evict_chunk` slots so the O(capacity) victim search is amortised over many
batches.

Low-precision stores (Yang et al.): with admit_all=False (on-demand cache in
front of an int8/int4 table) and policy lfu, a missed row is admitted only if
it has been used at least as often as the victim it would replace; rows not
admitted are read and updated straight in the store, dequantized and
requantized with the store's rounding.

Concurrency: the lookahead prefetcher calls prepare() on its own thread while
the trainer gathers, updates and releases; one lock guards the slot maps and
a condition variable wakes a prefetcher waiting for slots. On CUDA the fill
copies run on a side stream from pinned host memory; plan.ready is the event
the trainer waits on, and evictions wait for the trainer's last release.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from recsys_cli.embeddings.plan import LookupPlan
from recsys_cli.embeddings.tables import TableGroup
from recsys_cli.errors import UserError


class CacheTooSmall(UserError):
    """The cache cannot hold the unique rows of one batch."""


class PrefetchStopped(RuntimeError):
    pass


def cache_slots(num_rows: int, cache_rows: int | None, cache_ratio: float) -> int:
    slots = cache_rows if cache_rows is not None else int(round(num_rows * cache_ratio))
    return max(1, min(num_rows, slots))


class CachedGroup(TableGroup):
    def __init__(
        self, *args, cache_slots: int, policy: str = "lru", lookahead: bool = False, window: int = 1,
        admit_all: bool = True, store_tier: str = "host", evict_chunk: int | None = None, **kwargs,
    ) -> None:
        super().__init__(*args, store_tier=store_tier, **kwargs)
        self.kind = "lookahead" if lookahead else "cache"
        self.lookahead = lookahead
        self.window = window
        self.policy = policy
        self.admit_all = admit_all
        self.capacity = cache_slots
        self.evict_chunk = evict_chunk or max(1, cache_slots // 32)
        dev = self.device
        self.cache_rows = torch.zeros(cache_slots, self.dim, device=dev)
        self.cache_state = torch.zeros(cache_slots, self.store.state.shape[1], device=dev)
        self.slot_of_row = torch.full((self.num_rows,), -1, dtype=torch.int32)
        self.row_of_slot = torch.full((cache_slots,), -1, dtype=torch.int64)
        self.pins = torch.zeros(cache_slots, dtype=torch.int32)
        self.dirty = torch.zeros(cache_slots, dtype=torch.bool)
        self.score = torch.zeros(cache_slots, dtype=torch.int64)  # lru: last use clock; lfu: uses
        # A stack of free slots: the top `num_free` entries.
        self.free_slots = torch.arange(cache_slots - 1, -1, -1, dtype=torch.int64)
        self.num_free = cache_slots
        # LFU admission needs a count for rows that are not resident (LRU
        # admits every miss it has room for).
        self.row_uses = torch.zeros(self.num_rows, dtype=torch.int32) if not admit_all and policy == "lfu" else None
        self.clock = 0
        self.inflight = 0  # plans pinned and not yet released
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.stats_ = dict(hits=0, misses=0, rows_loaded=0, rows_evicted=0, rows_written_back=0,
                           bytes_to_device=0, bytes_to_host=0, not_admitted=0, prepare_seconds=0.0)
        self.side_stream = torch.cuda.Stream(dev) if (dev.type == "cuda" and lookahead) else None
        self.last_release = None
        # Distributed cache_avg (train/embedding_sync.py): slots that must not be
        # evicted yet (touched since the last cross-rank average), and a callback
        # prepare() makes when it cannot evict: True if room will come (a sync
        # was requested), so it waits instead of failing.
        self.evict_blocked: torch.Tensor | None = None
        self.on_starved = None

    # --- filling -------------------------------------------------------------
    def prepare(self, plan: LookupPlan) -> None:
        start = time.perf_counter()
        unique = plan.unique
        if self.admit_all and unique.numel() > self.capacity:
            raise CacheTooSmall(
                f"a batch needs {unique.numel()} unique rows of {len(self.tables)} cached tables "
                f"but the cache has {self.capacity} slots: raise placement.cache_rows / cache_ratio "
                f"or lower trainer.batch_size"
            )
        with self.cond:
            slots = self.slot_of_row[unique].to(torch.int64)
            hit = slots >= 0
            self.pins[slots[hit]] += 1  # hits first, so this batch's fill cannot evict them
            misses = unique[~hit]
            if self.row_uses is not None:
                self.row_uses[unique] += 1
                admitted = self._admit(misses)
            else:
                admitted = torch.ones(misses.numel(), dtype=torch.bool)
            need = int(admitted.sum())
            if not self.admit_all:
                # Rows that find no slot now stay in the store this step.
                room = self.num_free + int(((self.pins == 0) & (self.row_of_slot >= 0)).sum())
                if need > room:
                    admitted[torch.nonzero(admitted).flatten()[room:]] = False
                    need = room
            while self.num_free < need:
                if not self._evict(need - self.num_free):
                    waiting = self.on_starved is not None and self.on_starved()
                    if self.inflight == 0 and not waiting:
                        raise CacheTooSmall(
                            f"the cache of {self.capacity} slots cannot hold a batch's {unique.numel()} unique "
                            "rows: raise placement.cache_rows / cache_ratio or lower trainer.batch_size"
                        )
                    if self.stop.is_set():
                        self.pins[slots[hit]] -= 1
                        raise PrefetchStopped()
                    self.cond.wait(timeout=0.1)
            self.num_free -= need
            new_slots = self.free_slots[self.num_free : self.num_free + need].clone()
            load_rows = misses[admitted]
            self._load(load_rows, new_slots)
            miss_slots = torch.full((misses.numel(),), -1, dtype=torch.int64)
            miss_slots[admitted] = new_slots
            slots[~hit] = miss_slots
            resident = slots >= 0
            self.pins[new_slots] += 1
            self.clock += 1
            if self.policy == "lru":
                self.score[slots[resident]] = self.clock
            else:
                self.score[slots[resident]] += 1
            self.inflight += 1
            n_hit = int(hit.sum())
            self.stats_["hits"] += n_hit
            self.stats_["misses"] += unique.numel() - n_hit
            self.stats_["not_admitted"] += misses.numel() - need
        plan.slots = slots
        plan.extras["slots_device"] = slots.to(self.device, non_blocking=True)
        if self.side_stream is not None:
            plan.ready = torch.cuda.Event()
            plan.ready.record(self.side_stream)
        self.stats_["prepare_seconds"] += time.perf_counter() - start

    def _admit(self, misses: torch.Tensor) -> torch.Tensor:
        """LFU admission for rows that may stay in low precision: free slots
        go to the most used misses; beyond them a miss must be used at least
        as often as the least used evictable row."""
        if self.num_free >= misses.numel():
            return torch.ones(misses.numel(), dtype=torch.bool)
        uses = self.row_uses[misses]
        candidates = (self.pins == 0) & (self.row_of_slot >= 0)
        if bool(candidates.any()):
            admitted = uses >= self.row_uses[self.row_of_slot[candidates]].min()
        else:
            admitted = torch.zeros(misses.numel(), dtype=torch.bool)
        admitted[torch.argsort(uses, descending=True, stable=True)[: self.num_free]] = True
        return admitted

    def _evict(self, at_least: int) -> bool:
        """Free at least `at_least` slots (a chunk, to amortise the search).
        False if fewer unpinned slots exist."""
        candidates = (self.pins == 0) & (self.row_of_slot >= 0)
        if self.evict_blocked is not None:
            candidates &= ~self.evict_blocked
        available = int(candidates.sum())
        if available < at_least:
            return False
        count = min(available, max(at_least, self.evict_chunk))
        key = torch.where(candidates, self.score, torch.iinfo(torch.int64).max)
        victims = torch.topk(key, count, largest=False, sorted=False).indices
        self._write_back(victims[self.dirty[victims]])
        rows = self.row_of_slot[victims]
        self.slot_of_row[rows] = -1
        self.row_of_slot[victims] = -1
        self.score[victims] = 0
        self.free_slots[self.num_free : self.num_free + count] = victims
        self.num_free += count
        self.stats_["rows_evicted"] += count
        return True

    def _stream(self):
        return torch.cuda.stream(self.side_stream) if self.side_stream is not None else contextlib.nullcontext()

    def _write_back(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        with self._stream():
            if self.side_stream is not None and self.last_release is not None:
                self.side_stream.wait_event(self.last_release)
            dev_slots = slots.to(self.device)
            rows = self.cache_rows.index_select(0, dev_slots).to("cpu" if self.store.device.type == "cpu" else self.store.device)
            state = self.cache_state.index_select(0, dev_slots).to(rows.device)
            if self.side_stream is not None:
                self.side_stream.synchronize()
        self.store.write(self.row_of_slot[slots].to(self.store.device), rows.to(self.store.device), state.to(self.store.device))
        self.dirty[slots] = False
        self.stats_["rows_written_back"] += slots.numel()
        if self.store_tier == "host":
            self.stats_["bytes_to_host"] += rows.numel() * 4 + state.numel() * 4

    def _load(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        values, state = self.store.read(rows.to(self.store.device))
        with self._stream():
            if self.side_stream is not None and self.last_release is not None:
                self.side_stream.wait_event(self.last_release)
            dev_slots = slots.to(self.device, non_blocking=True)
            self.cache_rows.index_copy_(0, dev_slots, values.to(self.device, non_blocking=True))
            self.cache_state.index_copy_(0, dev_slots, state.to(self.device, non_blocking=True))
        self.slot_of_row[rows] = slots.to(torch.int32)
        self.row_of_slot[slots] = rows
        self.dirty[slots] = False
        self.stats_["rows_loaded"] += rows.numel()
        if self.store_tier == "host":
            self.stats_["bytes_to_device"] += values.numel() * 4 + state.numel() * 4

    # --- the step --------------------------------------------------------------
    def _resident(self, plan: LookupPlan) -> torch.Tensor | None:
        """Mask of cache-served rows, or None when all are cached."""
        if plan.slots is None:
            raise RuntimeError("a cached group's plan was not prepared")
        if self.admit_all:
            return None
        return plan.slots >= 0

    def gather(self, plan: LookupPlan) -> torch.Tensor:
        if plan.ready is not None:
            torch.cuda.current_stream().wait_event(plan.ready)
        slots_dev = plan.extras["slots_device"]
        mask = self._resident(plan)
        if mask is None:
            return self.cache_rows.index_select(0, slots_dev)
        rows = torch.empty(plan.num_unique, self.dim, device=self.device)
        mask_dev = mask.to(self.device)
        rows[mask_dev] = self.cache_rows.index_select(0, slots_dev[mask_dev])
        rows[~mask_dev] = self.store.rows.read(plan.unique[~mask].to(self.store.device)).to(self.device)
        return rows

    def update(self, plan: LookupPlan, rows: torch.Tensor, grad: torch.Tensor) -> None:
        slots_dev = plan.extras["slots_device"]
        mask = self._resident(plan)
        if mask is None:
            state = self.cache_state.index_select(0, slots_dev)
            rows, state = self.optimizer.step(rows, state, grad)
            self.cache_rows.index_copy_(0, slots_dev, rows)
            self.cache_state.index_copy_(0, slots_dev, state)
            self.dirty[plan.slots] = True
            return
        mask_dev = mask.to(self.device)
        cached = slots_dev[mask_dev]
        state = torch.empty(plan.num_unique, self.cache_state.shape[1], device=self.device)
        state[mask_dev] = self.cache_state.index_select(0, cached)
        direct = plan.unique[~mask].to(self.store.device)
        state[~mask_dev] = self.store.state.index_select(0, direct).to(self.device)
        rows, state = self.optimizer.step(rows, state, grad)
        self.cache_rows.index_copy_(0, cached, rows[mask_dev])
        self.cache_state.index_copy_(0, cached, state[mask_dev])
        self.dirty[plan.slots[mask]] = True
        self.store.write(direct, rows[~mask_dev].to(self.store.device), state[~mask_dev].to(self.store.device))

    def release(self, plan: LookupPlan) -> None:
        if plan.slots is None:
            return
        if self.device.type == "cuda" and self.side_stream is not None:
            self.last_release = torch.cuda.Event()
            self.last_release.record(torch.cuda.current_stream())
        with self.cond:
            resident = plan.slots[plan.slots >= 0]
            self.pins[resident] -= 1
            self.inflight -= 1
            self.cond.notify_all()
        plan.slots = None

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        with self.cond:
            slots = self.slot_of_row[ids].to(torch.int64)
            hit = slots >= 0
            rows = self.store.rows.read(ids.to(self.store.device)).to(self.device)
            if bool(hit.any()):
                rows[hit.to(self.device)] = self.cache_rows.index_select(0, slots[hit].to(self.device))
            return rows

    # --- whole tables ------------------------------------------------------------
    def flush(self) -> None:
        with self.cond:
            self._write_back(torch.nonzero(self.dirty).flatten())

    def invalidate(self) -> None:
        with self.cond:
            if self.inflight:
                raise RuntimeError("cannot reload tables while batches are in flight")
            self.slot_of_row.fill_(-1)
            self.row_of_slot.fill_(-1)
            self.dirty.zero_()
            self.score.zero_()
            self.free_slots = torch.arange(self.capacity - 1, -1, -1, dtype=torch.int64)
            self.num_free = self.capacity

    def memory(self) -> list[tuple[str, str, int]]:
        cache = self.cache_rows.numel() * 4 + self.cache_state.numel() * 4
        index = [self.slot_of_row, self.row_of_slot, self.pins, self.dirty, self.score, self.free_slots]
        if self.row_uses is not None:
            index.append(self.row_uses)
        index_bytes = sum(t.numel() * t.element_size() for t in index)
        return [(self.store_tier, "table", self.store.nbytes()), ("device", "cache", cache), ("host", "index", index_bytes)]

    def stats(self) -> dict:
        s = dict(self.stats_)
        s["cache_slots"] = self.capacity
        total = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / total if total else None
        return s
