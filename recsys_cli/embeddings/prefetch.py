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
    """Subclasses change how a plan is made resident (`_prepare`), what
    happens when the source runs dry (`_finish`) and which in-stream markers
    the trainer's thread handles (`_marker`); see train/embedding_sync.py."""

    thread_name = "recsys-prefetch"

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
        self.lead = True  # takes window slots; a follower replays another process's fills
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(self.window) if groups else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Prefetcher":
        if self.groups:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()
        return self

    def _prepare(self, group: CachedGroup, plan) -> None:
        group.prepare(plan)

    def _finish(self) -> None:
        """The source is exhausted (on the prefetch thread)."""

    def _marker(self, item) -> bool:
        """Handle a non-batch item on the trainer's thread; True if it was one."""
        return False

    def _run(self) -> None:
        try:
            for batch in self.source:
                if self.lead:
                    while not self._slots.acquire(timeout=0.1):
                        if self._stop.is_set():
                            return
                if self._stop.is_set():
                    return
                plans = batch.extras[PLANS]
                prepared = []
                try:
                    for index, group in self.indexed_groups:
                        self._prepare(group, plans[index])
                        prepared.append((group, plans[index]))
                except BaseException:
                    for group, plan in prepared:
                        group.release(plan)
                    raise
                self._queue.put(batch)
            self._finish()
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
            if self._marker(item):
                continue
            # Batches pinned right now, this one included: the window in use.
            self.window_used.append(min(g.inflight for g in self.groups))
            if self.lead:
                self._slots.release()
            yield item

    def __exit__(self, exc_type, *exc) -> None:
        if self._thread is None:
            _close(self.source)
            return
        self._stop.set()
        for g in self.groups:
            g.stop.set()
            with g.cond:
                g.cond.notify_all()
        # After an error a peer process may never answer the thread's collective.
        self._thread.join(timeout=30 if exc_type is None else 2)
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
        try:
            close()
        except ValueError:  # a generator still running on a thread that did not stop
            pass
