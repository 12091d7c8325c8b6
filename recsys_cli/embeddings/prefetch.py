"""Prefetcher: cDLRM's lookahead, a thread that fills the cache ahead of the trainer.

It takes planned batches from the loader and, for every lookahead group,
makes the batch's rows resident and pinned (CachedGroup.prepare), at most
`window` batches ahead of the one the trainer is on: prepare() itself waits
for the trainer, and decides what to evict from the batches alone, so the
run does not depend on how far ahead the thread got (cache.py, invariant 2).
When the cache cannot hold the rows of the whole window, the window shrinks
for that batch, and `window_used` records the window each batch was prepared
with. The trainer releases a batch's pins after its update.

Pauses: before the batch of a step listed by `pause_at` (evaluation and
checkpoint steps), the thread waits until the trainer has passed that step
(`passed`), so an evaluation reads, and a checkpoint saves, a cache with no
batch of a later step in it. An exception on the thread is raised in the
trainer; leaving early releases what was prefetched but never trained on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from recsys_cli.data.batch import Batch
from recsys_cli.embeddings.cache import CachedGroup, PrefetchStopped

_DONE = object()


class Prefetcher:
    """Subclasses change how a plan is made resident (`_prepare`), what
    happens when the source runs dry (`_finish`) and which in-stream markers
    the trainer's thread handles (`_marker`); see train/strategies/cache_fill.py."""

    thread_name = "recsys-prefetch"

    def __init__(
        self, batches: Iterator[Batch], groups: list[tuple[int, CachedGroup]], release: Callable[[Batch], None],
        start: int = 0, pause_at: Callable[[int], bool] | None = None,
    ) -> None:
        """groups: (index of the group's plan in Batch.plans, group);
        start: the step of the first batch; pause_at(step): wait for passed(step)
        before preparing that step's batch."""
        self.source = batches
        self.indexed_groups = groups
        self.groups = [g for _, g in groups]
        self.release = release
        self.window = min((g.window for g in self.groups), default=0)
        self.window_used: list[int] = []
        self.lead = True  # decides residency; a follower replays another process's fills
        self.pause_at = pause_at
        self._step = start  # step of the next batch to prepare
        self._passed = start
        self._passed_cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Prefetcher":
        if self.groups:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()
        return self

    def passed(self, step: int) -> None:
        """The trainer has finished everything it does at `step` (evaluation, checkpoint)."""
        with self._passed_cond:
            self._passed = step
            self._passed_cond.notify_all()

    def _prepare(self, group: CachedGroup, plan) -> None:
        group.prepare(plan)

    def _finish(self) -> None:
        """The source is exhausted (on the prefetch thread)."""

    def _marker(self, item) -> bool:
        """Handle a non-batch item on the trainer's thread; True if it was one."""
        return False

    def _wait_pause(self, step: int) -> bool:
        """False if stopped while waiting for the trainer to pass `step`."""
        if self.pause_at is None or not self.lead or not self.pause_at(step):
            return True
        with self._passed_cond:
            while self._passed < step:
                if self._stop.is_set():
                    return False
                self._passed_cond.wait(timeout=0.1)
        return True

    def _run(self) -> None:
        try:
            for batch in self.source:
                if self._stop.is_set() or not self._wait_pause(self._step):
                    return
                plans = batch.plans
                prepared = []
                try:
                    for index, group in self.indexed_groups:
                        self._prepare(group, plans[index])
                        prepared.append((group, plans[index]))
                except BaseException:
                    for group, plan in prepared:
                        group.release(plan)
                    raise
                self.window_used.append(min(g.last_window for g in self.groups))
                self._step += 1
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


def take(iterable, count: int) -> Iterator:
    """The first `count` items of `iterable`, closing its iterator when done
    (a loader's reader thread stops with it)."""
    it = iter(iterable)
    try:
        for _ in range(count):
            item = next(it, _DONE)
            if item is _DONE:
                return
            yield item
    finally:
        _close(it)


def _close(it) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        try:
            close()
        except ValueError:  # a generator still running on a thread that did not stop
            pass
