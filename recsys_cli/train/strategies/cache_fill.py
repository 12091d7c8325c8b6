"""cache_avg's batch stream: rank 0 fills every rank's caches (strategies/cache_avg.py).

On rank 0 the prefetcher thread fills the caches (CachedGroup.prepare) at most
`window` batches ahead and broadcasts every fill on the plan group: the slot
of every union row (the slot plan) and the rows it loaded with their
optimizer state. On the other ranks the same thread receives the fills and
copies them into the cache replica. SYNC markers (rank 0's requests for an
early average, when only rows touched since the last one could make room)
travel in the batch stream and are handled on the trainer's thread, at the
same place of the stream on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from recsys_cli.data.batch import Batch
from recsys_cli.embeddings.cache import CachedGroup, PrefetchStopped
from recsys_cli.embeddings.prefetch import Prefetcher
from recsys_cli.train.distributed import broadcast_

_SYNC = object()  # in a batch stream: every rank averages its cache rows here
FILL, SYNC = 1, 2  # kinds of rank 0's messages on the plan group


class CacheFillBroadcast(Prefetcher):
    """The prefetcher of cache_avg (see the module docstring)."""

    thread_name = "recsys-cache-fill"

    def __init__(self, source: Iterator[Batch], groups: list[tuple[int, CachedGroup]], release, sync,
                 start: int = 0, pause_at=None) -> None:
        super().__init__(source, groups, release, start, pause_at)
        self.sync = sync
        self.ctx = sync.ctx
        self.lead = self.ctx.is_main
        self._sends: list = []  # async SYNC broadcasts in flight (work, tensor)

    def __enter__(self) -> "CacheFillBroadcast":
        if self.lead:
            for g in self.groups:
                g.on_starved = self._starved_callback(g)
        return super().__enter__()

    def _prepare(self, group: CachedGroup, plan) -> None:
        (self._fill if self.lead else self._mirror)(group, plan)

    def _finish(self) -> None:
        self._wait_sends()

    def _marker(self, item) -> bool:
        if item is not _SYNC:
            return False
        self.sync.early_sync()
        return True

    def __exit__(self, exc_type, *exc) -> None:
        super().__exit__(exc_type, *exc)
        for g in self.groups:
            g.on_starved = None

    # --- rank 0 ---------------------------------------------------------------------
    def _bcast(self, tensor: torch.Tensor) -> torch.Tensor:
        return broadcast_(tensor, 0, self.ctx.plan_group)

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _starved_callback(self, group: CachedGroup):
        def starved() -> None:
            """Called by prepare (lock held, every earlier batch completed) when
            only rows awaiting a sync could give room: ask every rank for one here."""
            self._queue.put(_SYNC)
            header = torch.tensor([SYNC, 0, 0, 0], dtype=torch.int64)
            # Asynchronous: never wait on a peer while holding the cache lock.
            self._sends.append((dist.broadcast(header, 0, group=self.ctx.plan_group, async_op=True), header))

        return starved

    def _fill(self, group: CachedGroup, plan) -> None:
        replica = self.sync.replicas[id(group)]
        with group.cond:  # only this thread loads or evicts, so this is what prepare will load
            missing = group.slot_of_row[plan.unique] < 0
        group.prepare(plan)
        self._wait_sends()
        if plan.ready is not None:
            plan.ready.synchronize()
        load = torch.nonzero(missing).flatten()
        header = torch.tensor([FILL, replica.syncs, plan.num_unique, load.numel()], dtype=torch.int64)
        self._bcast(header)
        self._bcast(torch.cat([plan.slots, load]))
        if load.numel():
            dev_slots = plan.slots[load].to(group.device)
            payload = torch.cat([group.cache_rows.index_select(0, dev_slots),
                                 group.cache_state.index_select(0, dev_slots)], 1).cpu()
            self._bcast(payload)

    # --- other ranks --------------------------------------------------------------------
    def _mirror(self, group: CachedGroup, plan) -> None:
        replica = self.sync.replicas[id(group)]
        while True:
            header = self._bcast(torch.zeros(4, dtype=torch.int64))
            if int(header[0]) == SYNC:
                self._queue.put(_SYNC)
                continue
            break
        syncs, n, n_load = (int(x) for x in header[1:])
        if n != plan.num_unique:
            raise RuntimeError(
                f"rank {self.ctx.rank} planned {plan.num_unique} rows of a batch but rank 0 filled {n}: "
                "the ranks disagree on the batch stream"
            )
        ints = self._bcast(torch.zeros(n + n_load, dtype=torch.int64))
        slots, load = ints[:n], ints[n:]
        payload = None
        if n_load:
            payload = self._bcast(torch.zeros(n_load, group.dim + group.cache_state.shape[1]))
        with group.cond:
            while replica.syncs < syncs:  # the slots rank 0 reused are free here only after that sync
                if self._stop.is_set() or group.stop.is_set():
                    raise PrefetchStopped()
                group.cond.wait(timeout=0.1)
            if n_load:
                target = slots[load]
                rows = plan.unique[load]
                previous = group.slot_of_row[rows].to(torch.int64)
                group.row_of_slot[previous[previous >= 0]] = -1
                old = group.row_of_slot[target]
                group.slot_of_row[old[old >= 0]] = -1
                dev = target.to(group.device)
                group.cache_rows.index_copy_(0, dev, payload[:, : group.dim].to(group.device))
                group.cache_state.index_copy_(0, dev, payload[:, group.dim :].to(group.device))
                group.row_of_slot[target] = rows
                group.slot_of_row[rows] = target.to(torch.int32)
                group.stats_["rows_loaded"] += n_load
            group.pins[slots] += 1
            group.inflight += 1
            group.stats_["hits"] += n - n_load
            group.stats_["misses"] += n_load
        plan.slots = slots
        plan.slots_device = slots.to(group.device, non_blocking=True)

