"""Resident memory through a run: RSS sampled at every log step, for summary.json.

A run whose memory grows with its length (issue 18, goal 7) shows it here,
not only in the one peak figure. The trace itself stays bounded: past
`limit` samples every other one is dropped and the sampling interval doubles,
so a run of any length keeps at most `limit` samples, evenly spread.
"""

from __future__ import annotations

import ctypes
import os
import resource

__all__ = ["RSSTrace", "current_rss_bytes", "peak_rss_bytes", "return_free_memory"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int | None:
    """This process's resident set size now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: VmHWM of /proc/self/status,
    the high-water mark of this process image. Not getrusage's ru_maxrss (the
    fallback where /proc is missing): Linux carries it across exec, so a
    process started by a larger parent (a test suite, a launcher that
    imported torch) reports the parent's RSS as its own peak."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def return_free_memory() -> None:
    """Hand the C allocator's free pages back to the OS (glibc's malloc_trim;
    nothing where the C library has none). An evaluation's or a checkpoint's
    temporaries of some MB to tens of MB come from the heap once glibc's mmap
    threshold has risen, and the few allocations that outlive them keep the
    freed pages resident: RSS rose by about 200 MB with each evaluation of a
    3.3M-row split, and fell back to where it was with this after each."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _libc():
    try:
        return ctypes.CDLL(None)  # the process's own symbols: the C library's malloc
    except OSError:
        return None


class RSSTrace:
    """(step, RSS bytes) samples; `sample(step)` at every log step."""

    def __init__(self, limit: int = 256) -> None:
        if limit < 2:
            raise ValueError(f"limit must be >= 2, got {limit}")
        self.limit = limit
        self.samples: list[tuple[int, int]] = []
        self._every = 1  # keep one call in this many
        self._calls = 0

    def sample(self, step: int) -> None:
        self._calls += 1
        if (self._calls - 1) % self._every:
            return
        rss = current_rss_bytes()
        if rss is None:
            return
        self.samples.append((int(step), rss))
        if len(self.samples) > self.limit:
            self.samples = self.samples[::2]
            self._every *= 2

    def report(self) -> dict:
        """summary.json's `memory`: the samples and the peak (bytes)."""
        out: dict = {"rss_bytes": [list(s) for s in self.samples], "peak_rss_bytes": peak_rss_bytes()}
        if self.samples:
            out["rss_first_sample_bytes"] = self.samples[0][1]
            out["rss_last_sample_bytes"] = self.samples[-1][1]
        return out
