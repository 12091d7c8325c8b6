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
group has a lookahead cache, otherwise PlanAhead's thread), so it overlaps
training; always on the gloo plan group (distributed.py), so its collectives
never interleave with the main thread's. Every rank plans exactly the
batches it will train (the stream is cut at the end of the epoch or at
max_steps), so these collectives always pair up.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

from recsys_cli.data.batch import Batch
from recsys_cli.embeddings.prefetch import take
from recsys_cli.train.distributed import all_gather_split

_DONE = object()


def union_plan(batch: Batch, group) -> Batch:
    """Replace every plan's unique ids by their union over the ranks (sorted)
    and remap the inverse index."""
    per_rank = all_gather_split([p.unique for p in batch.plans], group)
    for g, plan in enumerate(batch.plans):
        plan.widen(torch.unique(torch.cat([parts[g] for parts in per_rank]), sorted=True))
    return batch


def union_batches(loader, limit: int, group) -> Iterator[Batch]:
    """The next `limit` batches of `loader`, with union plans."""
    source = take(loader, limit)
    try:
        for batch in source:
            yield union_plan(batch, group)
    finally:  # the loader's reader thread stops with it
        source.close()
class PlanAhead:
    """Union planning on its own thread, a few batches ahead, when no
    prefetcher thread would do it: the all-gather of ids then overlaps the
    step instead of adding its latency to it."""

    def __init__(self, source: Iterator[Batch], depth: int = 4) -> None:
        self.source = source
        self.window_used: list[int] = []
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recsys-plan", daemon=True)

    def __enter__(self) -> "PlanAhead":
        self._thread.start()
        return self

    def passed(self, step: int) -> None:
        """Planning fills no cache: nothing waits for the trainer."""

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for batch in self.source:
                if not self._put(batch):
                    return
            self._put(_DONE)
        except BaseException as e:  # surfaces in the trainer
            self._put(e)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30 if exc_type is None else 2)
        try:
            self.source.close()
        except ValueError:  # still running on a thread that did not stop
            pass
