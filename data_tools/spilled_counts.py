"""Counting every sparse value in bounded memory (`memory_budget=`), with the in-memory count's result.

Values are counted in one U32Map per feature, as the in-memory count does;
when the maps together pass the budget's share, their (feature, value,
count) entries are appended to PARTITIONS files, a value's partition chosen
by a hash of the value, and the maps start empty again. At the end every
partition is read in turn and its entries summed per (feature, value): a
value's counts all lie in one partition, so each partition gives the exact
total of the values it holds, and a partition's aggregation takes about
AGGREGATE_BYTES_PER_ENTRY bytes an entry (1/PARTITIONS of all flushed
entries). What comes out per feature (the values and their counts) is what
the in-memory count gives, in another order; the vocabulary orders it
(descending count, ties by value), so the ids are identical
(tests/test_preprocess_scale.py). What stays in memory whatever the budget:
per feature, the values that get an id (about 24 bytes each while the ids
are assigned), i.e. the vocabulary itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from data_tools.u32map import U32Map

PARTITIONS = 256
ENTRY = np.dtype([("key", "<u8"), ("count", "<i8")])  # key = feature << 32 | value
# np.unique over a partition's entries: the keys, their sort and inverse, the counts.
AGGREGATE_BYTES_PER_ENTRY = 48


def partition_of(values: np.ndarray) -> np.ndarray:
    """A value's partition: the top 8 bits of a multiplicative hash (not the
    bits U32Map's slots use, so a partition's values spread over a map)."""
    return ((values.astype(np.uint32) * np.uint32(0x9E3779B1)) >> np.uint32(24)).astype(np.intp)


class SpilledCounts:
    """Counts of each feature's values, spilled to `directory` past `budget` bytes of maps."""

    def __init__(self, directory: Path, features: int, budget: int):
        self.directory = Path(directory)
        self.features = features
        self.budget = budget
        self.maps = [U32Map() for _ in range(features)]
        self.flushes = 0
        self.files: list = []

    def count(self, f: int, values: np.ndarray) -> None:
        self.maps[f].count(values)

    def nbytes(self) -> int:
        return sum(m.slots.nbytes + m.vals.nbytes for m in self.maps)

    def maybe_flush(self) -> None:
        if self.nbytes() > self.budget:
            self.flush()

    def flush(self) -> None:
        if not self.files:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.files = [open(self.directory / f"part-{k:03d}.bin", "ab") for k in range(PARTITIONS)]
        for f, m in enumerate(self.maps):
            keys, counts = m.items()
            if not len(keys):
                continue
            entries = np.empty(len(keys), dtype=ENTRY)
            entries["key"] = (np.uint64(f) << np.uint64(32)) | keys.astype(np.uint64)
            entries["count"] = counts
            part = partition_of(keys)
            order = np.argsort(part, kind="stable")
            bounds = np.searchsorted(part[order], np.arange(PARTITIONS + 1))
            for k in range(PARTITIONS):
                if bounds[k + 1] > bounds[k]:
                    entries[order[bounds[k]:bounds[k + 1]]].tofile(self.files[k])
            self.maps[f] = U32Map()
        self.flushes += 1

    def close(self) -> None:
        for fh in self.files:
            fh.close()
        self.files = []

    def frequent(self, min_count: int) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
        """(feature, values seen at least min_count times, their counts, the
        feature's distinct values) of every feature in order."""
        if not self.flushes:  # everything fitted: the maps hold the counts
            for f, m in enumerate(self.maps):
                keys, counts = m.items()
                self.maps[f] = U32Map()
                frequent = counts >= min_count
                yield f, keys[frequent], counts[frequent], int(len(keys))
            return
        self.flush()
        self.close()
        kept: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(self.features)]
        distinct = [0] * self.features
        for k in range(PARTITIONS):
            path = self.directory / f"part-{k:03d}.bin"
            entries = np.fromfile(path, dtype=ENTRY)
            path.unlink()
            if not len(entries):
                continue
            keys, inverse = np.unique(entries["key"], return_inverse=True)
            counts = np.bincount(inverse, weights=entries["count"], minlength=len(keys)).astype(np.int64)
            del entries, inverse
            feature = (keys >> np.uint64(32)).astype(np.intp)
            bounds = np.searchsorted(feature, np.arange(self.features + 1))
            for f in range(self.features):
                lo, hi = int(bounds[f]), int(bounds[f + 1])
                distinct[f] += hi - lo
                keep = lo + np.flatnonzero(counts[lo:hi] >= min_count)
                if len(keep):
                    kept[f].append(((keys[keep] & np.uint64(0xFFFFFFFF)).astype(np.uint32), counts[keep]))
        self.directory.rmdir()  # every partition file read and removed: nothing of the count stays in the output
        for f in range(self.features):
            parts = kept[f]
            kept[f] = []
            if parts:
                yield f, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), distinct[f]
            else:
                yield f, np.zeros(0, np.uint32), np.zeros(0, np.int64), distinct[f]
