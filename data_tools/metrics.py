"""ROC AUC: the one implementation the generator (hidden-model AUC) and the
trainer (evaluation) share. numpy only, so data_tools stays free of torch."""

from __future__ import annotations

import numpy as np


# Tie groups per pass of the rank sum: its temporaries stay a few MB on a
# split of any size.
_GROUPS_PER_PASS = 1 << 20


def roc_auc(scores, labels) -> float:
    """Exact ROC AUC over all samples by the rank-sum (Mann-Whitney U)
    formula, tied scores sharing their average rank; nan when only one class
    is present. Takes numpy arrays or CPU tensors (labels > 0.5 are positive)."""
    scores = np.asarray(scores).ravel()
    if scores.dtype.kind != "f":
        scores = scores.astype(np.float64)
    # A float array is sorted as it is: widening float32 is exact and keeps
    # the order and the ties, and its copy would be the sort's largest array.
    labels = np.asarray(labels).ravel() > 0.5
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    labels = labels[order]
    del order
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])  # of each tie group
    del sorted_scores
    # Ranks are half-integers and every partial sum is below 2**52, so this is
    # exact, as the sum over positives' ranks was, with no array of ranks per
    # sample and only a pass's share of the per-group arrays at a time.
    rank_sum_pos = 0.0
    for first in range(0, starts.size, _GROUPS_PER_PASS):
        group_starts = starts[first:first + _GROUPS_PER_PASS]
        end = starts[first + _GROUPS_PER_PASS] if first + _GROUPS_PER_PASS < starts.size else labels.size
        lo = group_starts[0]
        positives = np.add.reduceat(labels[lo:end], group_starts - lo, dtype=np.int64)  # positives per tie group
        avg_rank = (group_starts + np.r_[group_starts[1:], end] + 1) / 2.0  # 1-based average rank of each group
        rank_sum_pos += float((avg_rank * positives).sum())
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)
