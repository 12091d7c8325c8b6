"""Reader-side dedup (RecD): multi-hot columns as runs of equal adjacent bags.

Session-clustered shards store a session's shared history in adjacent rows,
so one comparison with the previous row over the file order (once per row
group, `bag_runs`) finds them; permutation and batching then handle one bag
per run instead of one per sample, and a batch's distinct bags come from its
runs through dedup.py's `unique_bags_of_runs`, the same code `dedup_kjt` runs:
a deduplicated batch from the loader equals ``dedup_kjt`` of the plain batch.
"""

from __future__ import annotations

import numpy as np
import torch

from recsys_cli.data.dedup import InverseKeyedJaggedTensor, repeats_previous, unique_bags_of_runs, unique_onehot
from recsys_cli.data.jagged import take_bags

__all__ = ["BagRuns", "bag_runs", "dedup_batch"]


class BagRuns:
    """Bags of one multi-hot column of a row group, one per run of equal adjacent rows."""

    __slots__ = ("offsets", "values", "run_of_row")

    def __init__(self, offsets: np.ndarray, values: np.ndarray, run_of_row: np.ndarray) -> None:
        self.offsets = offsets  # int64 [runs + 1]
        self.values = values  # int64: the runs' bags
        self.run_of_row = run_of_row  # int64 [rows]: run of each (permuted) row


def bag_runs(offsets: np.ndarray, values: np.ndarray, perm: np.ndarray | None) -> BagRuns:
    """A multi-hot column (offsets [n+1], values, in file order) as BagRuns;
    `perm`: the row group's row order (None: file order)."""
    lo = int(offsets[0])
    offsets = offsets.astype(np.int64) - lo
    values = values[lo : lo + int(offsets[-1])]
    repeat = repeats_previous(values, np.diff(offsets))
    heads = np.flatnonzero(~repeat)
    run_of_row = np.cumsum(~repeat) - 1
    run_offsets, run_values = take_bags(offsets, values, heads)
    return BagRuns(run_offsets, run_values, run_of_row if perm is None else run_of_row[perm])


def _batch_runs(pieces: list[tuple[BagRuns, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs that rows [a, b) of each piece use, numbered in order of their
    first row in the batch: (values, lengths, run of each row)."""
    values, lengths, run_of = [], [], []
    base = 0
    for runs, a, b in pieces:
        used, first, inverse = np.unique(runs.run_of_row[a:b], return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        off, vals = take_bags(runs.offsets, runs.values, used[order])
        values.append(vals)
        lengths.append(np.diff(off))
        run_of.append(rank[inverse.reshape(-1)] + base)
        base += len(order)
    if not pieces:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(values), np.concatenate(lengths), np.concatenate(run_of)


def dedup_batch(pieces: list, features: list[str], multi_keys: list[str], onehot_keys: list[str],
                B: int) -> InverseKeyedJaggedTensor:
    """The sparse part of a batch of rows [a, b) of decoded row groups
    (pieces: (DecodedRowGroup, a, b), in batch order) as an
    InverseKeyedJaggedTensor, without expanding multi-hot bags per sample."""
    if pieces and onehot_keys:
        ids = np.concatenate([c.onehot[:, a:b] for c, a, b in pieces], axis=1) if len(pieces) > 1 else \
            pieces[0][0].onehot[:, pieces[0][1] : pieces[0][2]]
        onehot = dict(zip(onehot_keys, unique_onehot(torch.from_numpy(np.ascontiguousarray(ids)))))
    else:
        onehot = {f: (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)) for f in onehot_keys}
    values, lengths, counts, inverse = [], [], [], []
    for f in features:
        if f in onehot:
            u_vals, inv = onehot[f]
            u_lens = torch.ones(u_vals.numel(), dtype=torch.int64)
        else:
            k = multi_keys.index(f)
            run_values, run_lengths, run_of = _batch_runs([(c.multi[k], a, b) for c, a, b in pieces])
            u_vals, u_lens, inv = unique_bags_of_runs(
                torch.from_numpy(run_values), torch.from_numpy(run_lengths), torch.from_numpy(run_of))
        values.append(u_vals)
        lengths.append(u_lens)
        counts.append(u_lens.numel())
        inverse.append(inv)
    F = len(features)
    return InverseKeyedJaggedTensor(
        keys=list(features),
        values=torch.cat(values) if values else torch.zeros(0, dtype=torch.int64),
        lengths=torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int64),
        unique_counts=counts,
        inverse=torch.stack(inverse).view(F, B) if inverse else torch.zeros((0, B), dtype=torch.int64),
        stride=B,
    )
