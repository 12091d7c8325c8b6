"""Prefetcher: cDLRM's lookahead, a thread that fills the cache ahead of the trainer.

It takes planned batches from the loader and, for every lookahead group,
makes the batch's rows resident and pinned (CachedGroup.prepare), at most
`window` batches ahead of the one the trainer is on. The trainer releases a
batch's pins after its update, which lets later batches evict those rows.
When the cache cannot hold the rows of the whole window, prepare() waits for
releases: the window shrinks, and `window_used` records how far ahead the
prefetcher really was at each step. An exception on the thread is raised in
the trainer; leaving early releases what was prefetched but never trained on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from recsys_cli.data.batch import Batch
from recsys_cli.embeddings.cache import CachedGroup, PrefetchStopped
from recsys_cli.embeddings.collection import PLANS

_DONE = object()


class Prefetcher:
    def __init__(
        self, batches: Iterator[Batch], groups: list[tuple[int, CachedGroup]], release: Callable[[Batch], None]
    ) -> None:
        """groups: (index of the group's plan in Batch.extras[PLANS], group)."""
        self.source = batches
        self.indexed_groups = groups
        self.groups = [g for _, g in groups]
        self.release = release
        self.window = min((g.window for g in self.groups), default=0)
        self.window_used: list[int] = []
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(self.window) if groups else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Prefetcher":
        if self.groups:
            self._thread = threading.Thread(target=self._run, name="recsys-prefetch", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for batch in self.source:
                while not self._slots.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                plans = batch.extras[PLANS]
                prepared = []
                try:
                    for index, group in self.indexed_groups:
                        group.prepare(plans[index])
                        prepared.append(plans[index])
                except BaseException:
                    for plan in prepared:
                        plan_group = next(g for i, g in self.indexed_groups if plans[i] is plan)
                        plan_group.release(plan)
                    raise
                self._queue.put(batch)
            self._queue.put(_DONE)
        except PrefetchStopped:
            pass
        except BaseException as e:  # surfaces in the trainer, never a hang
            self._queue.put(e)

    def __iter__(self) -> Iterator[Batch]:
        if not self.groups:
            yield from self.source
            return
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            # Batches pinned right now, this one included: the window in use.
            self.window_used.append(min(g.inflight for g in self.groups))
            self._slots.release()
            yield item

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            _close(self.source)
            return
        self._stop.set()
        for g in self.groups:
            g.stop.set()
            with g.cond:
                g.cond.notify_all()
        self._thread.join(timeout=30)
        for g in self.groups:
            g.stop.clear()
        # Batches prefetched but never trained on give their pins back.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Batch):
                self.release(item)
        _close(self.source)


def _close(it) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()
