"""Union plans: every rank serves the rows of the whole global batch.

Every rank trains on its own contiguous slice of each global batch
(ShardLoader rank/world_size; trainer.batch_size is the global batch). A
rank's lookup plan covers the rows of its slice only, but in both sync modes
(strategies/) every rank must hold, and update, the rows of the whole global
batch. So every rank replaces each plan's unique row ids by their union over
the ranks (an all-gather of the unique ids, padded to the longest) and remaps
its inverse index into the union. The union is sorted: it is exactly the plan
one process would make for the global batch (the same rows in the same order,
the same cache fills), and rows outside the rank's slice simply get a zero
gradient from it. Chosen over "every rank reads the whole global batch"
because the loader then decodes only the rank's slice; the price is one small
all-gather of ids per batch.

It runs on the thread that plans batches ahead (the prefetcher thread when a
group has a lookahead cache, otherwise UnionAhead's thread), so it overlaps
training; always on the gloo prefetch group (distributed.py), so its collectives
never interleave with the main thread's. Every rank plans exactly the
batches it will train (the feed is cut at the end of the epoch or at
max_steps), so these collectives always pair up.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from data_tools.background import BackgroundIterator
from recsys_cli.data.batch import Batch
from recsys_cli.embeddings.prefetch import take
from recsys_cli.train.distributed import all_gather_split

def union_plan(batch: Batch, group, pin=None) -> Batch:
    """Replace every plan's unique ids by their union over the ranks (sorted)
    and remap the inverse index; `pin` (CUDA: the runtime's) pins the new
    tensors as the loader pinned the old ones, so their copies stay asynchronous."""
    plans = batch.plans
    assert plans is not None, "the loader's transform plans every batch (plan_batch)"
    per_rank = all_gather_split([p.unique for p in plans], group)
    for g, plan in enumerate(plans):
        plan.widen(torch.unique(torch.cat([parts[g] for parts in per_rank]), sorted=True))
    if pin is not None:
        batch.plans = [plan.pin_memory(pin) for plan in plans]
    return batch


def union_batches(loader, limit: int, group, pin=None) -> Iterator[Batch]:
    """The next `limit` batches of `loader`, with union plans (pinned by `pin`)."""
    source = take(loader, limit)
    try:
        for batch in source:
            yield union_plan(batch, group, pin)
    finally:  # the loader's reader thread stops with it
        source.close()
class UnionAhead:
    """Union plans made on their own thread, a few batches ahead, when no
    prefetcher thread would do it: the all-gather of ids then overlaps the
    step instead of adding its latency to it. A batch feed like Prefetcher
    (strategies/base.py, BatchFeed) on data_tools' BackgroundIterator."""

    def __init__(self, source: Iterator[Batch], depth: int = 4) -> None:
        self.source = source
        self.depth = depth
        self.window_used: list[int] = []
        self._thread: BackgroundIterator | None = None

    def __enter__(self) -> "UnionAhead":
        self._thread = BackgroundIterator(self.source, depth=self.depth, name="recsys-union")
        return self

    def __iter__(self) -> Iterator[Batch]:
        if self._thread is None:
            raise RuntimeError("UnionAhead is iterated inside its with block (which starts its thread)")
        return iter(self._thread)

    def passed(self, step: int) -> None:
        """Union plans fill no cache: nothing waits for the trainer."""

    def __exit__(self, exc_type, *exc) -> None:
        # After an error a peer process may never answer the thread's all-gather.
        if self._thread is not None:
            self._thread.close(timeout=30 if exc_type is None else 2)
