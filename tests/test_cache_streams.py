"""The cache's CUDA ordering, checked on CPU through a recording runtime:
readers wait for the fill of what they read, loads and write-backs wait for
the last use of their slots (cache_avg's averages included), and the step
never indexes a device tensor with a boolean mask."""

from __future__ import annotations

import queue
import sys
import threading

import torch
from embedding_harness import build, make_batches
from test_device_paths import RecordingRuntime
from torch.overrides import TorchFunctionMode

from recsys_cli.embeddings.cache import CachedGroup


def _group(placement: dict, precision: dict | None = None, optimizer: str = "adagrad"):
    model, _ = build(placement, precision, optimizer=optimizer)
    groups = [g for g in model.embeddings.groups if isinstance(g, CachedGroup)]
    assert len(groups) == 1
    return model, groups[0]


def _step(model, group: CachedGroup, batch) -> None:
    """One training step of the embeddings, the plan prepared on this thread."""
    plan = batch.plans[0]
    if not group.lookahead:
        group.prepare(plan)
    pooled = model.embeddings(batch)
    (pooled.float() ** 2).sum().backward()
    model.embeddings.step()
    model.embeddings.release(batch)


def test_readers_wait_for_the_fill_recorded_before_the_rows_are_published():
    model, group = _group({"kind": "lookahead", "cache_rows": 400, "window": 2})
    runtime = RecordingRuntime()
    group.use_runtime(runtime, side_stream=True)
    mapped_at_fill = []
    record = runtime.event

    def event(timing=False):  # at every record on the side stream: which rows were readable then
        e = record(timing)
        inner = e.record

        def recorded(stream=None):
            if stream is group.side_stream:
                mapped_at_fill.append(group.slot_index.contains(torch.arange(group.num_rows)))
            inner(stream)

        e.record = recorded
        return e

    runtime.event = event
    batch = model.embeddings.plan_batch(make_batches(1)[0])
    plan = batch.plans[0]
    group.prepare(plan)
    assert not bool(mapped_at_fill[0][plan.unique].any())  # the fill's event came before the slot map
    fill = group.last_fill.name
    runtime.log.clear()
    group.read(plan.unique)  # an evaluation while the prefetcher fills
    assert ("wait", "compute", fill) in runtime.log
    runtime.log.clear()
    group.gather(plan)
    assert runtime.log[0] == ("wait", "compute", plan.ready.name)
    assert runtime.log[1] == ("record_stream", "compute")  # slots_device, made on the side stream
    model.embeddings.pending().clear()


def test_loads_and_write_backs_wait_for_the_last_step_that_used_their_slots_and_every_average():
    """A slot that a load overwrites or a write-back reads is used by no batch from the
    prepare's first protected batch on: its last step is the release of the batch
    before that one, which the load waits for, with the last write_slots (cache_avg's
    averages), and not for the newest release: a prefetcher a window ahead must not
    wait for the step the device is computing now."""
    model, group = _group({"kind": "lookahead", "cache_rows": 150, "window": 1})
    runtime = RecordingRuntime()
    group.use_runtime(runtime, side_stream=True)
    released, averaged, checked, older = {}, None, 0, 0
    for i, batch in enumerate(make_batches(12)):
        batch = model.embeddings.plan_batch(batch)
        runtime.log.clear()
        group.prepare(batch.plans[0])
        waits = {entry[2] for entry in runtime.log if entry[0] == "wait" and entry[1] == group.side_stream.name}
        if waits:
            first = i - group.last_window
            want = {released[first - 1]} if first - 1 in released else set()
            assert waits == want | ({averaged} if averaged else set()), (i, waits, want, averaged)
            checked += 1
            older += first - 1 < i - 1  # not the newest release
        _step(model, group, batch)
        released[i] = group.released[-1][1].name
        # cache_avg: after the step, averaged rows are written into their slots (and made dirty).
        slots = torch.nonzero(group.row_of_slot >= 0).flatten()[:5]
        group.write_slots(slots, group.cache_rows[slots] * 0.5, group.cache_state[slots])
        group.dirty[slots] = True
        averaged = group.last_outside.name
    assert group.stats()["rows_written_back"] > 0 and checked > 5 and older > 0


def test_loads_after_an_evaluation_wait_for_its_reads_of_the_cache():
    """An evaluation reads resident rows on the compute stream between steps; the
    next fills may evict those slots, so their loads and write-backs wait for the
    event recorded after the read, however far the device lags (a host sync in the
    evaluation must not be what keeps the rows intact)."""
    model, group = _group({"kind": "lookahead", "cache_rows": 150, "window": 1})
    runtime = RecordingRuntime()
    group.use_runtime(runtime, side_stream=True)
    waited = 0
    for i, batch in enumerate(make_batches(12)):
        batch = model.embeddings.plan_batch(batch)
        runtime.log.clear()
        group.prepare(batch.plans[0])
        waits = {entry[2] for entry in runtime.log if entry[0] == "wait" and entry[1] == group.side_stream.name}
        if i and waits:
            assert read_event in waits, (i, waits, read_event)
            waited += 1
        _step(model, group, batch)
        resident = group.row_of_slot[group.row_of_slot >= 0][:7]
        group.read_as_saved(resident)  # the evaluation after this step
        read_event = group.last_outside.name
        assert runtime.log[-1][:2] == ("record", read_event)
    assert waited > 5 and group.stats()["rows_written_back"] > 0


class _MaskWatch(TorchFunctionMode):
    """Records boolean-mask indexing and nonzero: on a CUDA tensor each is a device sync."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in ("__getitem__", "__setitem__"):
            index = args[1]
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                self.seen.append(name)
        if name in ("nonzero", "masked_select", "argwhere"):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_the_low_precision_step_indexes_with_host_built_index_tensors_only():
    for placement in ({"kind": "cache", "cache_rows": 60}, {"kind": "lookahead", "cache_rows": 60, "window": 1}):
        model, group = _group(placement, {"kind": "int8"})
        served_by_store = 0
        for batch in make_batches(6):
            batch = model.embeddings.plan_batch(batch)
            plan = batch.plans[0]
            group.prepare(plan)  # host bookkeeping: masks on host tensors are free
            served_by_store += int((plan.slots < 0).sum())
            watch = _MaskWatch()
            with watch:  # gather, pooling, backward, update: the step's device work
                pooled = model.embeddings(batch)
                (pooled.float() ** 2).sum().backward()
                model.embeddings.step()
            assert watch.seen == [], (placement, watch.seen)
            model.embeddings.release(batch)  # host bookkeeping
        assert served_by_store > 0  # the split path (cache and store) ran


class _GatedRuntime(RecordingRuntime):
    """A recording runtime whose waits on the side stream (its synchronize,
    or an event recorded on it) block until `gate` is set, as a host wait
    on a busy GPU would; `waiting` says one has started."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.waiting, self.armed = threading.Event(), threading.Event(), False
        self.side = None

    def _block(self) -> None:
        if self.armed:
            self.waiting.set()
            assert self.gate.wait(10), "the gate was never opened"

    def new_stream(self):
        stream = super().new_stream()
        inner = stream.synchronize
        stream.synchronize = lambda: (self._block(), inner())
        self.side = stream
        return stream

    def event(self, timing=False):
        e = super().event(timing)
        inner = e.synchronize
        e.synchronize = lambda: (self._block() if e.stream is self.side else None, inner())
        return e


def test_release_does_not_wait_while_a_write_back_waits_for_the_device():
    """An eviction's write-back copies dirty rows off the device; the wait for
    that copy must not hold the cache's lock, or the trainer's release()
    (and so the whole step) waits for the GPU to catch up."""
    model, group = _group({"kind": "lookahead", "cache_rows": 150, "window": 1})
    runtime = _GatedRuntime()
    group.use_runtime(runtime, side_stream=True)
    batches = [model.embeddings.plan_batch(b) for b in make_batches(12)]
    for batch in batches[:8]:  # fill the cache with dirty rows
        group.prepare(batch.plans[0])
        _step(model, group, batch)
    a, b = batches[8], batches[9]
    group.prepare(a.plans[0])
    pooled = model.embeddings(a)
    (pooled.float() ** 2).sum().backward()
    model.embeddings.step()  # a is trained, not yet released
    written = group.counters["rows_written_back"]
    runtime.armed = True
    prefetch = threading.Thread(target=group.prepare, args=(b.plans[0],))
    prefetch.start()
    try:
        assert runtime.waiting.wait(10), "the prefetcher's prepare never waited for the device"
        released = threading.Thread(target=model.embeddings.release, args=(a,))
        released.start()
        released.join(5)
        assert not released.is_alive(), "release() waited for the write-back's device copy"
    finally:
        runtime.gate.set()
        prefetch.join(10)
    assert group.counters["rows_written_back"] > written  # b's prepare wrote dirty rows back
    assert runtime.copies["device_to_host_pinned"] > 0 and runtime.copies["device_to_host_pageable"] == 0
    model.embeddings.release(b)


class _MoveWatch(TorchFunctionMode):
    """Counts the calls that would copy between host and device on CUDA:
    .to(a device), .cpu(), .cuda(), and asynchronous copy_ (into a pinned buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.moves = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name, kwargs = getattr(func, "__name__", ""), kwargs or {}
        if sys._getframe(1).f_code.co_filename.endswith("slot_index.py"):  # host memory only, by design
            pass
        elif name == "to" and any(isinstance(a, (str, torch.device)) for a in (*args[1:], *kwargs.values())):
            self.moves += 1
        elif name in ("cpu", "cuda") or (name == "copy_" and (kwargs.get("non_blocking") or args[2:3] == (True,))):
            self.moves += 1
        return func(*args, **kwargs)


def test_every_host_device_copy_of_the_step_is_counted_and_none_is_pageable():
    """Through a recording runtime (it stands in for CUDA): the copies the
    runtime counts are all the moves the step makes (fills, write-backs, rows
    the store serves and their updates, slot indices), so a pageable count of
    0 means none; on CUDA each of them would be a synchronous copy."""
    for placement, precision in (({"kind": "lookahead", "cache_rows": 150, "window": 1}, None),
                                 ({"kind": "lookahead", "cache_rows": 60, "window": 1}, {"kind": "int8"}),
                                 ({"kind": "cache", "cache_rows": 60}, {"kind": "int8"})):
        model, group = _group(placement, precision)
        runtime = RecordingRuntime()
        group.use_runtime(runtime, side_stream=True)
        watch = _MoveWatch()
        for batch in make_batches(10):
            batch = model.embeddings.plan_batch(batch)
            with watch:
                if group.lookahead:
                    group.prepare(batch.plans[0])
                _step(model, group, batch)
        stats, copies = group.stats(), runtime.copies
        assert stats["rows_written_back"] > 0 and stats["rows_loaded"] > 0, placement
        assert copies["host_to_device_pageable"] == 0 and copies["device_to_host_pageable"] == 0, (placement, copies)
        assert sum(copies.values()) == watch.moves, (placement, copies, watch.moves)
        assert copies["device_to_host_pinned"] > 0 and copies["host_to_device_pinned"] > 0


def test_an_event_another_thread_waits_on_is_recorded_before_it_is_published():
    """The prefetcher waits on `last_use` (and the trainer on `last_fill` and
    a staging buffer's copy event) from another thread: an event that is
    assigned first and recorded after can be read in between, and a wait on
    an event never recorded waits for nothing, so a fill could overwrite
    slots the compute stream still reads. Every record must happen before
    the event is visible where the other thread looks."""
    for placement in ({"kind": "lookahead", "cache_rows": 150, "window": 1}, {"kind": "cache", "cache_rows": 150}):
        model, group = _group(placement)
        runtime = RecordingRuntime()
        group.use_runtime(runtime, side_stream=True)
        staging = [s for pair in (group.fill_staging, group.step_staging, group.back_staging) if pair for s in pair]
        published_early = []
        make = runtime.event

        def event(timing=False):
            e = make(timing)
            inner = e.record

            def record(stream=None):
                visible = [group.last_use, group.last_fill, *(s._copied for s in staging)]
                if any(v is e for v in visible):
                    published_early.append(e.name)
                inner(stream)

            e.record = record
            return e

        runtime.event = event
        for batch in make_batches(10):
            batch = model.embeddings.plan_batch(batch)
            if group.lookahead:
                group.prepare(batch.plans[0])
            _step(model, group, batch)
        assert group.stats()["rows_written_back"] > 0 and group.last_use is not None
        assert published_early == [], placement


def test_an_evaluations_reads_copy_through_pinned_buffers():
    """Evaluation reads rows with group.read: a host table's rows and a cache's
    misses go to the device through pinned staging, never as a pageable
    (synchronous) copy; so do a low-precision cache's dirty rows, to the host
    and back, rounded as a checkpoint rounds them (CachedGroup._as_saved)."""
    lookahead = {"kind": "lookahead", "cache_rows": 150, "window": 1}
    for placement, precision in (({"kind": "host"}, None), ({"kind": "cache", "cache_rows": 150}, None),
                                 (lookahead, None), ({"kind": "cache", "cache_rows": 150}, {"kind": "int8"}),
                                 (lookahead, {"kind": "int4"})):
        model, _ = build(placement, precision, optimizer="adagrad")
        group = model.embeddings.groups[0]
        runtime = RecordingRuntime()
        group.use_runtime(runtime, **({"side_stream": True} if isinstance(group, CachedGroup) else {}))
        for batch in make_batches(3):
            batch = model.embeddings.plan_batch(batch)
            if isinstance(group, CachedGroup):
                group.prepare(batch.plans[0])
            _step_any(model, batch)
        if precision is not None:
            assert bool(group.dirty.any())
            before = runtime.copies["device_to_host_pinned"]
        with torch.no_grad():
            for batch in make_batches(2, seed=5):
                model.embeddings(model.embeddings.plan_batch(batch))  # not recording: group.read
        assert runtime.copies["host_to_device_pageable"] == 0, (placement, runtime.pageable_sites)
        assert runtime.copies["device_to_host_pageable"] == 0, (placement, runtime.pageable_sites)
        assert runtime.copies["host_to_device_pinned"] > 0
        if precision is not None:  # the dirty rows went to the host to be rounded
            assert runtime.copies["device_to_host_pinned"] > before


def _step_any(model, batch) -> None:
    pooled = model.embeddings(batch)
    (pooled.float() ** 2).sum().backward()
    model.embeddings.step()
    model.embeddings.release(batch)


def test_a_low_precision_step_whose_rows_all_have_slots_never_waits_for_the_device():
    """A lookahead cache over int8 tables admits every miss it has room for; a batch
    whose rows all have slots is stepped as an fp32 cache's is. The split step (some
    rows in the store) waits for the device every step, to write those rows back
    to the host store from their pinned copies: on a GPU the trainer could then
    never run ahead of it (the H200's int4 + lookahead 1 % ran at 0.56x device
    placement where fp32's ran at 0.68x, every store row admitted)."""
    for cache_rows, split in ((4000, False), (30, True)):
        model, group = _group({"kind": "lookahead", "cache_rows": cache_rows, "window": 1}, {"kind": "int8"})
        runtime = RecordingRuntime()
        group.use_runtime(runtime, side_stream=True)
        waits, served = 0, 0
        for batch in make_batches(6):
            batch = model.embeddings.plan_batch(batch)
            plan = batch.plans[0]
            group.prepare(plan)
            served += plan.served is not None
            runtime.log.clear()
            _step(model, group, batch)
            waits += sum(entry[0] == "synchronize" for entry in runtime.log)
        assert (served > 0, waits > 0) == (split, split), (cache_rows, served, waits)
        model.embeddings.pending().clear()


def test_the_all_cached_path_of_a_low_precision_step_is_the_split_paths_bits():
    """The same batches through a cache that takes the fp32 path when every row has a slot,
    and through one made to split every plan: the same rows, state and store, bit for bit."""
    runs = []
    for force_split in (False, True):
        model, group = _group({"kind": "lookahead", "cache_rows": 4000, "window": 1}, {"kind": "int4"})
        for batch in make_batches(8):
            batch = model.embeddings.plan_batch(batch)
            plan = batch.plans[0]
            group.prepare(plan)
            assert plan.served is None  # every row has a slot
            if force_split:
                plan.served = group._served(plan.unique, plan.slots)
            _step(model, group, batch)
        model.embeddings.pending().clear()
        tables = {(name, key): value.clone() if isinstance(value, torch.Tensor) else value
                  for name, table in group.table_state().items() for key, value in table.items()}
        runs.append((group.cache_rows.clone(), group.cache_state.clone(), tables))
    (rows_a, state_a, tables_a), (rows_b, state_b, tables_b) = runs
    assert torch.equal(rows_a, rows_b) and torch.equal(state_a, state_b)
    assert tables_a.keys() == tables_b.keys() and any(isinstance(v, torch.Tensor) for v in tables_a.values())
    for key, value in tables_a.items():
        assert torch.equal(value, tables_b[key]) if isinstance(value, torch.Tensor) else value == tables_b[key], key



def test_every_load_and_write_back_waits_for_the_last_step_that_used_its_slot():
    """The invariant behind the waits, whatever the window did: a slot a load
    overwrites, or a write-back reads, was last used by some batch's step; the
    side stream waits for that batch's release (or a later one) first. The
    prefetcher runs on its own thread, as in training, so windows shrink and
    prepares wait for the trainer."""
    configs = [(150, 3, "lru", None), (120, 2, "lru", None), (220, 4, "lru", None), (150, 3, "lfu", None),
               (120, 1, "lfu", None), (110, 3, "lru", 60), (130, 4, "lfu", 70)]
    for cache_rows, window, policy, chunk in configs:  # chunk: an eviction frees more than it needs
        model, group = _group({"kind": "lookahead", "cache_rows": cache_rows, "window": window, "policy": policy})
        group.evict_chunk = chunk or group.evict_chunk
        runtime = RecordingRuntime()
        group.use_runtime(runtime, side_stream=True)
        batches = [model.embeddings.plan_batch(b) for b in make_batches(30, seed=window)]
        prepared = queue.Queue()
        seen = []  # per prepare: (batch, slots it used, loaded slots, written-back slots, events waited)

        def prefetch():
            waits, phase = [], ["load"]
            side_wait = group.side_stream.wait_event
            group.side_stream.wait_event = lambda e: (waits.append((phase[0], e.name)), side_wait(e))
            for name in ("_write_back", "_load"):  # which of the two each wait is for
                method = getattr(group, name)
                setattr(group, name, lambda *a, _m=method, _n=name, **k: (phase.__setitem__(0, _n), _m(*a, **k))[1])
            for i, batch in enumerate(batches):
                rows_before, dirty_before = group.row_of_slot.clone(), group.dirty.clone()
                waits.clear()
                fill = group.prepare(batch.plans[0])
                evicted = torch.nonzero((rows_before >= 0) & (group.row_of_slot != rows_before)).flatten()
                seen.append((i, fill.slots[fill.slots >= 0], fill.slots[fill.loaded],
                             evicted[dirty_before[evicted]], list(waits)))
                prepared.put(batch)

        thread = threading.Thread(target=prefetch)
        thread.start()
        batch_of: dict[str, int] = {}  # release event -> batch
        for j in range(len(batches)):
            _step(model, group, prepared.get(timeout=30))
            batch_of[group.released[-1][1].name] = j
        thread.join()
        model.embeddings.pending().clear()
        checked = newest_skipped = 0
        for i, _, loaded, written_back, waits in seen:
            for slots, phase in ((loaded, "_load"), (written_back, "_write_back")):
                waited = max((batch_of.get(e, -1) for p, e in waits if p == phase), default=-1)
                used_before = [j for j, used, _, _, _ in seen[:i] if bool(torch.isin(slots, used).any())]
                if used_before:
                    assert max(used_before) <= waited, (cache_rows, window, policy, i, phase, max(used_before), waited)
                    checked += 1
                    newest_skipped += waited < i - 1
        assert checked > 10 and newest_skipped > 0, (cache_rows, window, policy, checked, newest_skipped)
