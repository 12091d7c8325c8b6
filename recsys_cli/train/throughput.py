"""Honest throughput: steady-state training samples/s beside the wall clock.

A run's samples divided by its whole fit loop is not training throughput: it
includes the wait for the first batch, the first steps' allocations, and
every periodic evaluation and checkpoint (a 20-step run reported 230
samples/s that way). The meter keeps them apart:

  steady state   samples of the steps after the warm-up, over the time from
                 the end of the warm-up to the end of the last step, minus
                 the time spent in evaluations and checkpoints in between
  wall clock     from the start of fit() to the report, everything included
  eval / checkpoint seconds, whenever they happen (periodic and final)

The trainer calls start() when fit() begins, step() after each training
step, wraps evaluations and checkpoints in paused(), end_training() when the
last step is done, and report() for summary.json. `sync` waits for the
device (CUDA) at the edges of the steady window, so queued work is counted
where it runs.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Optional

MAX_WARMUP_STEPS = 10
CLOCK: Callable[[], float] = time.perf_counter  # the meters' clock unless given one (tests give a fake)


def warmup_steps(steps: int) -> int:
    """Steps left out at the start of a fit of `steps` steps: a tenth, at
    least one (the first batch's wait and allocations) and at most
    MAX_WARMUP_STEPS; none for a single step, which has nothing after it."""
    return 0 if steps < 2 else min(MAX_WARMUP_STEPS, max(1, steps // 10))


class ThroughputMeter:
    def __init__(self, steps: int, sync: Optional[Callable[[], None]] = None,
                 clock: Optional[Callable[[], float]] = None) -> None:
        self.warmup = warmup_steps(steps)
        self.sync = sync or (lambda: None)
        self.clock = clock or CLOCK
        self.steps = 0
        self.seconds = {"eval": 0.0, "checkpoint": 0.0}
        self._paused = 0.0  # seconds inside paused(), all kinds
        self._depth = 0
        self._start: float | None = None
        self._start_samples = 0  # a resumed run starts from its checkpoint's count
        self._mark: tuple[float, int, float] | None = None  # (time, samples, paused) where the steady window opens
        self._end: tuple[float, int, float] | None = None  # ... and where it closes

    def start(self, samples: int = 0) -> None:
        """fit() begins; `samples` is the run's total so far (resumed runs)."""
        self._start, self._start_samples = self.clock(), samples
        if self.warmup == 0:
            self._mark = (self._start, samples, self._paused)

    def step(self, samples: int) -> None:
        """After a training step; `samples` is the run's running total."""
        self.steps += 1
        if self.steps == self.warmup:
            self.sync()
            self._mark = (self.clock(), samples, self._paused)

    def end_training(self, samples: int) -> None:
        """The last training step is done: the steady window closes here."""
        self.sync()
        self._end = (self.clock(), samples, self._paused)

    @contextmanager
    def paused(self, kind: str):
        """Time that is not training (an evaluation, a checkpoint): counted
        under `kind` and left out of the steady state."""
        self._depth += 1
        began = self.clock()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                spent = self.clock() - began
                self.seconds[kind] = self.seconds.get(kind, 0.0) + spent
                self._paused += spent

    @property
    def steady(self) -> tuple[int, float] | None:
        """(samples, seconds) of the steady window; None before it closes or
        when no step came after the warm-up."""
        if self._mark is None or self._end is None:
            return None
        samples = self._end[1] - self._mark[1]
        seconds = (self._end[0] - self._mark[0]) - (self._end[2] - self._mark[2])
        return (samples, seconds) if samples > 0 and seconds > 0 else None

    @property
    def samples_per_second(self) -> float | None:
        steady = self.steady
        return None if steady is None else steady[0] / steady[1]

    def report(self, samples: int) -> dict:
        """summary.json's "throughput": `samples` is the run's total at the end."""
        wall = self.clock() - self._start if self._start is not None else None
        steady = self.steady
        trained = samples - self._start_samples  # by this process's fit
        return {
            "steady_samples_per_second": self.samples_per_second,
            "steady_samples": steady[0] if steady else 0,
            "steady_seconds": steady[1] if steady else 0.0,
            "warmup_steps": self.warmup,
            "steps": self.steps,
            "wall_seconds": wall,
            "wall_samples_per_second": trained / wall if wall else None,
            "eval_seconds": self.seconds.get("eval", 0.0),
            "checkpoint_seconds": self.seconds.get("checkpoint", 0.0),
        }
