"""ROC AUC: the one implementation the generator (hidden-model AUC) and the
trainer (evaluation) share. numpy only, so data_tools stays free of torch."""

from __future__ import annotations

import numpy as np


def roc_auc(scores, labels) -> float:
    """Exact ROC AUC over all samples by the rank-sum (Mann-Whitney U)
    formula, tied scores sharing their average rank; nan when only one class
    is present. Takes numpy arrays or CPU tensors (labels > 0.5 are positive)."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    labels = np.asarray(labels).ravel() > 0.5
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    del sorted_scores
    positives = np.add.reduceat(labels[order], starts, dtype=np.int64)  # positives per tie group
    del order
    ends = np.r_[starts[1:], scores.size]
    avg_rank = (starts + ends + 1) / 2.0  # 1-based average rank of each tie group
    # Ranks are half-integers and every partial sum is below 2**52, so this is
    # exact, as the sum over positives' ranks was, without an array of ranks
    # per sample (evaluation's peak memory on a split of millions of rows).
    rank_sum_pos = float((avg_rank * positives).sum())
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)
