"""BackgroundIterator: run an iterator on its own thread, a bounded number of items ahead.

The one background pipeline of the project (the shard loader, the cache
prefetcher, distributed plan-ahead and the Criteo preprocessor all use it).
It lives in data_tools so that both packages can import it (data_tools never
imports recsys_cli).

Contract:

* ``BackgroundIterator(source, depth)`` starts one daemon thread that iterates
  ``source`` and hands its items over a queue of at most ``depth`` items; the
  thread holds at most one more (the one waiting for room), so memory is
  bounded by ``depth + 1`` items whatever the consumer's speed.
* The consumer iterates the BackgroundIterator. The items arrive in order,
  then one end marker ends the iteration. An exception raised by ``source`` is
  re-raised in the consumer, with its traceback, after the items produced
  before it.
* ``close()`` (also on ``with`` exit, on an error or end in the consumer, and
  when the iterator is garbage-collected) sets the one stop event, waits for the
  thread (``join_timeout`` seconds, then a RuntimeWarning names the thread),
  then calls ``source.close()`` if it has one (from the producer thread, so a
  generator's ``finally`` and a nested BackgroundIterator stop there), and
  hands every item produced but never delivered to ``discard`` on the caller's
  thread. It is idempotent; ``next()`` after it raises StopIteration.
* A producer that waits on something of its own (another thread, a condition)
  polls ``stop`` (pass your own Event as ``stop=`` to share it) so that close
  never waits for more than a poll.

The thread does not refer to the BackgroundIterator object (only to the queue,
the event and the source), so dropping the last reference to it closes it.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["BackgroundIterator"]

T = TypeVar("T")

# How often a blocked producer (queue full) and a waiting consumer look at the
# stop event and the thread's liveness. Only matters at close or if the thread dies.
POLL_S = 0.05


class _End:
    """The end marker; carries the producer's exception, if any."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put, waiting for room while not stopped; False if stopped first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator, q: queue.Queue, stop: threading.Event, undelivered: list) -> None:
    try:
        for item in source:
            if not _put(q, item, stop):
                undelivered.append(item)  # discarded by close(), on the consumer's thread
                return
            if stop.is_set():
                return
        _put(q, _End(), stop)
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
        _put(q, _End(e), stop)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            try:
                close()
            except BaseException as e:  # noqa: BLE001 - the consumer still gets a result
                _put(q, _End(e), stop)


class BackgroundIterator(Generic[T]):
    """Items of ``source``, produced on a daemon thread up to ``depth`` ahead (see the module docstring)."""

    def __init__(
        self,
        source: Iterable[T],
        depth: int = 2,
        *,
        name: str = "recsys-background",
        join_timeout: float = 30.0,
        discard: Callable[[T], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.stop = stop if stop is not None else threading.Event()
        self.join_timeout = join_timeout
        self._discard = discard
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._undelivered: list = []
        self._closed = False
        self._thread = threading.Thread(
            target=_produce, args=(iter(source), self._queue, self.stop, self._undelivered), name=name, daemon=True
        )
        self._thread.start()

    def __iter__(self) -> "BackgroundIterator[T]":
        return self

    def __next__(self) -> T:
        if self._closed:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError(f"background thread {self._thread.name} ended without a result") from None
        if isinstance(item, _End):
            self.close()
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread, wait for it, discard what it produced that was never delivered."""
        if self._closed:
            return
        self._closed = True
        self.stop.set()
        pending = self._drain()  # a producer blocked on a full queue sees the stop at once
        if self._thread is not threading.current_thread():
            self._thread.join(self.join_timeout if timeout is None else timeout)
            if self._thread.is_alive():
                warnings.warn(f"background thread {self._thread.name} did not stop within "
                              f"{self.join_timeout if timeout is None else timeout} s", RuntimeWarning, stacklevel=2)
        pending += self._drain() + self._undelivered
        self._undelivered.clear()
        if self._discard is not None:
            for item in pending:
                if not isinstance(item, _End):
                    self._discard(item)

    def _drain(self) -> list:
        out = []
        try:
            while True:
                out.append(self._queue.get_nowait())
        except queue.Empty:
            return out

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def __enter__(self) -> "BackgroundIterator[T]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=2.0)
        except Exception:  # interpreter shutdown
            pass
