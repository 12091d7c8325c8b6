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
batch of a later step in it. A stop the trainer decides while training
(preemption: train/preemption.py) is a pause too: `hold` stops the thread
before its next batch and says the first step it has not prepared, and
`stop_after(step)` lets it go on up to that step, where it pauses. An
exception on the thread is raised in the trainer; leaving early releases
what was prefetched but never trained on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator

from data_tools.background import BackgroundIterator
from recsys_cli.data.batch import Batch
from recsys_cli.embeddings.cache import CachedGroup, PrefetchStopped

_DONE = object()


class Prefetcher:
    """The batch feed of a run with lookahead caches: a context manager
    that iterates the prepared batches. The thread is data_tools' one
    BackgroundIterator; this class adds what a cache needs around it: the
    pauses, stopping the caches' waits on exit, and releasing batches that
    were prepared but never trained on.

    Subclasses change how a plan is made resident (`_prepare`, a generator
    that may yield control items into the feed ahead of the batch), what
    happens when the source runs dry (`_finish`) and how the trainer's thread
    handles a control item (`_control`); see train/strategies/cache_fill.py."""

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
        self.decides_residency = True  # False: a follower rank replays rank 0's fills (and pauses with them)
        self.pause_at = pause_at
        self._step = start  # step of the next batch to prepare
        self._passed = start
        self._passed_cond = threading.Condition()
        self._checked = start  # the first step not yet cleared to prepare
        self._held = False  # hold(): clear no further step until stop_after()
        self._stop_after: int | None = None  # a pause the trainer added while training
        self._stop = threading.Event()
        self._thread: BackgroundIterator | None = None

    def __enter__(self) -> "Prefetcher":
        if self.groups:
            # Deep enough never to hold the thread back: prepare() itself keeps
            # it at most `window` batches ahead (plus a few control items).
            self._thread = BackgroundIterator(self._produce(), depth=self.window + 4, name=self.thread_name,
                                              discard=self._discard, stop=self._stop)
        return self

    def passed(self, step: int) -> None:
        """The trainer has finished everything it does at `step` (evaluation, checkpoint)."""
        with self._passed_cond:
            self._passed = step
            self._passed_cond.notify_all()

    def _prepare(self, group: CachedGroup, plan) -> Iterator:
        """Make the plan's rows resident (on the prefetch thread); yields control items, if any."""
        group.prepare(plan)
        yield from ()

    def _finish(self) -> None:
        """The source is exhausted (on the prefetch thread)."""

    def _control(self, item) -> None:
        """Handle a control item on the trainer's thread."""
        raise TypeError(f"unexpected item in the batch feed: {item!r}")

    def hold(self) -> int:
        """Prepare no batch past those already cleared until stop_after();
        returns the first step whose batch is not cleared (the earliest step
        after which the cache holds no later batch)."""
        with self._passed_cond:
            self._held = True
            return self._checked

    def stop_after(self, step: int) -> None:
        """Go on preparing up to `step` (>= hold()'s answer) and pause there."""
        with self._passed_cond:
            self._stop_after, self._held = step, False
            self._passed_cond.notify_all()

    def _pauses(self, step: int) -> bool:
        return step == self._stop_after or (self.pause_at is not None and self.pause_at(step))

    def _wait_pause(self, step: int) -> bool:
        """False if stopped while waiting for the trainer to pass `step` (or to release a hold)."""
        with self._passed_cond:
            if self.decides_residency:  # a follower replays rank 0's fills: rank 0 pauses for it
                while self._held or (self._pauses(step) and self._passed < step):
                    if self._stop.is_set():
                        return False
                    self._passed_cond.wait(timeout=0.1)
            self._checked = step + 1
        return True

    def _produce(self) -> Iterator:
        """The prefetch thread: prepared batches, and control items before a batch."""
        try:
            for batch in self.source:
                if self._stop.is_set() or not self._wait_pause(self._step):
                    return
                prepared = []
                plans = batch.plans
                assert plans is not None, "the loader's transform plans every batch (plan_batch)"
                try:
                    for index, group in self.indexed_groups:
                        yield from self._prepare(group, plans[index])
                        prepared.append((group, plans[index]))
                except BaseException:
                    for group, plan in prepared:
                        group.release(plan)
                    raise
                self.window_used.append(min(g.last_window for g in self.groups))
                self._step += 1
                yield batch
            self._finish()
        except PrefetchStopped:  # stopped while waiting on a cache
            pass

    def _discard(self, item) -> None:
        """A batch prefetched but never trained on gives its pins back."""
        if isinstance(item, Batch):
            self.release(item)

    def __iter__(self) -> Iterator[Batch]:
        if self._thread is None:
            yield from self.source
            return
        for item in self._thread:
            if isinstance(item, Batch):
                yield item
            else:
                self._control(item)

    def __exit__(self, exc_type, *exc) -> None:
        if self._thread is None:
            _close(self.source)
            return
        self._stop.set()
        for g in self.groups:
            g.interrupt_waits()
        # After an error a peer process may never answer the thread's collective.
        self._thread.close(timeout=30 if exc_type is None else 2)
        for g in self.groups:
            g.allow_waits()
        _close(self.source)


def take(iterable, count: int) -> Generator:
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
