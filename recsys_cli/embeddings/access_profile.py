"""How often each row of each table is read in a sample of batches: what the placement search buys device bytes for.

  measure_access   one pass over a sample of batches: per table, how often
                   each row is read and the most unique rows one batch needs
                   (an AccessProfile)
  measure_skew     per table, the hottest rows that serve target_hit_rate of
                   the accesses
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable

import numpy as np

from recsys_cli.errors import UserError


@dataclass
class AccessProfile:
    """Row access counts per table from a sample of batches."""

    counts: dict[str, np.ndarray]  # per table: reads of each row (int64 [num_rows])
    batch_unique_rows: dict[str, int]  # per table: the most unique rows one batch read
    batches: int = 0

    @property
    def reads(self) -> dict[str, int]:
        """Per table, all reads in the sample (place_tables's `reads`)."""
        return {name: int(c.sum()) for name, c in self.counts.items()}

    def hot_rows(self, target_hit_rate: float = 0.9) -> dict[str, int]:
        """Per table, the fewest rows that serve target_hit_rate of its reads."""
        if not 0 < target_hit_rate <= 1:
            raise UserError(f"target hit rate must be in (0, 1], got {target_hit_rate}")
        return {name: rows_covering(c, target_hit_rate) for name, c in self.counts.items()}


def rows_covering(counts: np.ndarray, fraction: float) -> int:
    """The fewest rows whose counts add up to at least `fraction` of the total."""
    total = int(counts.sum())
    if total == 0:
        return 0
    # Exact decimal arithmetic: 0.7 of 10 reads is 7 reads, not 7.000000000000001.
    need = max(1, math.ceil(Fraction(repr(float(fraction))) * total))
    nonzero = counts[counts > 0]
    cumulative = np.cumsum(np.sort(nonzero)[::-1])
    return int(np.searchsorted(cumulative, need, side="left")) + 1


def measure_access(batches: Iterable, features: list[str], vocab_sizes: list[int]) -> AccessProfile:
    """Count reads per row of each feature's table over `batches`.

    `batches` yields KeyedJaggedTensors (or Batches; deduplicated ones are expanded) with
    ids local to each feature's table; a key absent from a batch counts as no
    reads. An id outside its table raises UserError."""
    if len(features) != len(vocab_sizes):
        raise ValueError(f"{len(features)} features but {len(vocab_sizes)} vocabulary sizes")
    counts = {f: np.zeros(n, dtype=np.int64) for f, n in zip(features, vocab_sizes)}
    unique = {f: 0 for f in features}
    seen = 0
    for batch in batches:
        kjt = getattr(batch, "sparse", batch)
        if hasattr(kjt, "to_kjt"):  # a deduplicated batch: count every sample's reads
            kjt = kjt.to_kjt()
        seen += 1
        values = kjt.values.detach().cpu().numpy()
        per_key = kjt.lengths.detach().cpu().view(len(kjt.keys), kjt.stride).sum(1).tolist() if kjt.keys else []
        start = 0
        for key, length in zip(kjt.keys, per_key):
            ids, start = values[start : start + length], start + length
            if key not in counts or ids.size == 0:
                continue
            vocab = counts[key].size
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= vocab:
                raise UserError(f"feature {key} has id {lo if lo < 0 else hi} outside its table of {vocab:,} rows")
            counts[key] += np.bincount(ids, minlength=vocab)
            unique[key] = max(unique[key], int(np.unique(ids).size))
    return AccessProfile(counts, unique, seen)


def measure_skew(
    batches: Iterable, features: list[str], vocab_sizes: list[int], target_hit_rate: float = 0.9
) -> dict[str, int]:
    """Per table, how many of its hottest rows serve target_hit_rate of the reads
    in `batches` (KeyedJaggedTensors, ids local to each table, key-major)."""
    if not 0 < target_hit_rate <= 1:
        raise UserError(f"target hit rate must be in (0, 1], got {target_hit_rate}")
    return measure_access(batches, features, vocab_sizes).hot_rows(target_hit_rate)
