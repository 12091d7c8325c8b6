"""data_tools.background.BackgroundIterator: order, error forwarding, early close, bounded memory."""

import gc
import itertools
import threading
import time
import warnings

import pytest

from data_tools.background import BackgroundIterator


def _alive(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


# Liveness bounds, not latencies: a close takes milliseconds; CLOSED_S tells a
# thread that stopped from one that waits out the 30 s join timeout, with room
# for a loaded machine that leaves a thread unscheduled for seconds.
CLOSED_S = 10.0


def _wait_gone(name: str, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        gc.collect()
        if not _alive(name):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def test_items_in_order_then_end():
    it = BackgroundIterator(range(1000), depth=3, name="bg-order")
    assert list(it) == list(range(1000))
    assert not it.thread.is_alive()
    with pytest.raises(StopIteration):
        next(it)


def test_runs_on_its_own_thread():
    seen = []

    def source():
        for i in range(3):
            seen.append(threading.current_thread().name)
            yield i

    assert list(BackgroundIterator(source(), name="bg-own")) == [0, 1, 2]
    assert seen == ["bg-own"] * 3


def test_error_reaches_consumer_after_earlier_items():
    def source():
        yield 1
        yield 2
        raise KeyError("boom in producer")

    it = BackgroundIterator(source(), depth=1, name="bg-error")
    got = []
    with pytest.raises(KeyError, match="boom in producer") as info:
        for x in it:
            got.append(x)
    assert got == [1, 2]
    # the traceback leads into the producer's frame
    assert any(tb.name == "source" for tb in info.traceback)
    assert _wait_gone("bg-error")


def test_early_close_does_not_hang_or_leak_and_closes_the_source():
    closed = threading.Event()
    closed_on = []

    def endless():
        try:
            for i in itertools.count():
                yield i
        finally:
            closed_on.append(threading.current_thread().name)
            closed.set()

    it = BackgroundIterator(endless(), depth=2, name="bg-early")
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    t0 = time.perf_counter()
    it.close()
    assert time.perf_counter() - t0 < CLOSED_S
    assert not it.thread.is_alive()
    assert closed.is_set() and closed_on == ["bg-early"]  # the generator's finally ran on its thread
    with pytest.raises(StopIteration):
        next(it)
    it.close()  # idempotent


def test_break_out_of_with_block_and_dropped_iterator_stop_the_thread():
    with BackgroundIterator(itertools.count(), name="bg-with") as it:
        for i in it:
            if i == 3:
                break
    assert _wait_gone("bg-with")
    it = BackgroundIterator(itertools.count(), name="bg-dropped")
    next(it)
    del it  # the thread holds no reference to the iterator: dropping it closes it
    assert _wait_gone("bg-dropped")


def test_nested_iterators_stop_from_the_outside():
    def stage(inner):
        for x in BackgroundIterator(inner, depth=1, name="bg-inner"):
            yield x * 2

    outer = BackgroundIterator(stage(itertools.count()), depth=1, name="bg-outer")
    assert [next(outer) for _ in range(3)] == [0, 2, 4]
    outer.close()
    assert _wait_gone("bg-outer") and _wait_gone("bg-inner")


def test_memory_is_bounded_by_depth():
    produced = []

    def source():
        for i in itertools.count():
            produced.append(i)
            yield i

    depth = 3
    it = BackgroundIterator(source(), depth=depth, name="bg-bounded")
    for consumed in range(1, 20):
        next(it)
        time.sleep(0.02)  # a slow consumer: the producer runs ahead as far as it may
        # queued (depth) + the one waiting for room + the one being made
        assert len(produced) <= consumed + depth + 2
    assert len(produced) >= 19 + depth  # and it did run ahead
    it.close()


def test_undelivered_items_are_discarded_on_the_callers_thread():
    discarded, threads = [], set()

    def discard(x):
        discarded.append(x)
        threads.add(threading.current_thread().name)

    it = BackgroundIterator(iter(range(100)), depth=4, name="bg-discard", discard=discard)
    got = [next(it) for _ in range(2)]
    time.sleep(0.1)  # let the producer fill the queue
    it.close()
    assert threads == {threading.current_thread().name}
    # everything produced was either delivered or discarded, once
    assert got == [0, 1] and discarded == list(range(2, 2 + len(discarded)))
    assert len(discarded) >= 4


def test_producer_waiting_on_the_shared_stop_event_is_released():
    stop = threading.Event()
    gate = threading.Event()  # never set: the producer waits for it, polling the stop event

    def source():
        yield 0
        while not gate.wait(0.01):
            if stop.is_set():
                return
        yield 1

    it = BackgroundIterator(source(), stop=stop, name="bg-stop")
    assert next(it) == 0
    t0 = time.perf_counter()
    it.close()
    assert time.perf_counter() - t0 < CLOSED_S and not it.thread.is_alive()


def test_join_timeout_warns_instead_of_hanging():
    release = threading.Event()

    def stuck():
        yield 0
        release.wait(10)  # ignores the stop event
        yield 1

    it = BackgroundIterator(stuck(), name="bg-stuck", join_timeout=0.2)
    next(it)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        it.close()
    assert any("bg-stuck" in str(x.message) for x in w)
    release.set()
    assert _wait_gone("bg-stuck")


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth"):
        BackgroundIterator([], depth=0)
