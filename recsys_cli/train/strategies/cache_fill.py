"""cache_avg's batch feed: rank 0 fills every rank's caches (strategies/cache_avg.py).

On rank 0 the prefetcher thread fills the caches (CachedGroup.prepare) at most
`window` batches ahead and broadcasts every fill on the prefetch group: the slot
of every union row (the slot plan) and the rows it loaded with their
optimizer state. On the other ranks the same thread receives the fills and
copies them into the cache replica. SYNC markers (rank 0's requests for an
early average, when only rows touched since the last one could make room)
travel in the batch feed and are handled on the trainer's thread, at the
same place of the feed on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from recsys_cli.data.batch import Batch
from recsys_cli.embeddings.cache import CachedGroup, RowsHeld
from recsys_cli.embeddings.plan import Fill
from recsys_cli.embeddings.prefetch import Prefetcher
from recsys_cli.train.distributed import broadcast_

_SYNC = object()  # in a batch feed: every rank averages its cache rows here
FILL, SYNC = 1, 2  # kinds of rank 0's messages on the prefetch group


class CacheFillBroadcast(Prefetcher):
    """The prefetcher of cache_avg (see the module docstring)."""

    thread_name = "recsys-cache-fill"

    def __init__(self, source: Iterator[Batch], groups: list[tuple[int, CachedGroup]], release, strategy,
                 start: int = 0, pause_at=None) -> None:
        super().__init__(source, groups, release, start, pause_at)
        self.strategy = strategy  # the CacheAvg strategy: its averages, early or every k steps
        self.ctx = strategy.ctx
        self.decides_residency = self.ctx.is_main
        self._sends: list = []  # async SYNC broadcasts in flight (work, tensor)

    def _prepare(self, group: CachedGroup, plan) -> Iterator:
        if self.decides_residency:
            yield from self._fill_and_send(group, plan)
        else:
            yield from self._receive_fill(group, plan)

    def _finish(self) -> None:
        self._wait_sends()

    def _control(self, item) -> None:
        if item is _SYNC:
            self.strategy.early_sync()
        else:
            super()._control(item)

    # --- rank 0 ---------------------------------------------------------------------
    def _bcast(self, tensor: torch.Tensor) -> torch.Tensor:
        return broadcast_(tensor, 0, self.ctx.prefetch_group)

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _fill_and_send(self, group: CachedGroup, plan) -> Iterator:
        while True:
            try:
                fill = group.prepare(plan)
                break
            except RowsHeld as starved:
                # Only rows awaiting an average could make room (every earlier
                # batch is completed): ask every rank for one at this place of
                # the feed, and prepare again once this rank's trainer did it.
                header = torch.tensor([SYNC, 0, 0, 0], dtype=torch.int64)
                self._sends.append((dist.broadcast(header, 0, group=self.ctx.prefetch_group, async_op=True), header))
                yield _SYNC
                self.strategy.wait_averaged(group, starved.batch, self._stop)
        self._wait_sends()
        values = group.loaded_values(plan, fill) if fill.loaded.numel() else None
        header = torch.tensor([FILL, self.strategy.syncs_of(group), plan.num_unique, fill.loaded.numel()], dtype=torch.int64)
        self._bcast(header)
        self._bcast(torch.cat([fill.slots, fill.loaded]))
        if values is not None:
            self._bcast(values)

    # --- other ranks --------------------------------------------------------------------
    def _receive_fill(self, group: CachedGroup, plan) -> Iterator:
        while True:
            header = self._bcast(torch.zeros(4, dtype=torch.int64))
            if int(header[0]) == SYNC:
                yield _SYNC  # at the place of the feed where rank 0 put it
                continue
            break
        syncs, n, n_load = (int(x) for x in header[1:])
        if n != plan.num_unique:
            raise RuntimeError(
                f"rank {self.ctx.rank} planned {plan.num_unique} rows of a batch but rank 0 filled {n}: "
                "the ranks disagree on the batch feed"
            )
        ints = self._bcast(torch.zeros(n + n_load, dtype=torch.int64))
        values = self._bcast(torch.zeros(n_load, group.row_width)) if n_load else None
        # The slots rank 0 reused are free here only after the average that freed them.
        self.strategy.wait_syncs(group, syncs, self._stop)
        group.apply(plan, Fill(ints[:n], ints[n:]), values)
