"""Small parquet datasets for tests, written with pyarrow directly.

Every row is identifiable: ``dense[:, 0]`` is the row's index within its split
(exact in float32 below 2**24), ``dense[:, 1]`` is the split's number.
One-hot feature ``C{k}`` (k = 1..) holds ``(row * k + k) % vocab``; multi-hot
feature ``H{k}`` holds ``row % 4`` ids (empty bags included), id j being
``(row + j * k) % vocab``. With sessions, session ids increase along the file
and row groups end at session boundaries.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_tools.manifest import NUM_DENSE, Manifest, Shard, SparseFeature, Split, sha256_file

SPLIT_CODE = {"train": 0, "val": 1, "test": 2}


def onehot_ids(rows: np.ndarray, k: int, vocab: int) -> np.ndarray:
    return ((rows * k + k) % vocab).astype(np.int32)


def multihot_bag(row: int, k: int, vocab: int) -> list[int]:
    return [(row + j * k) % vocab for j in range(row % 4)]


def _table(rows: np.ndarray, split: str, onehot: int, multihot: int, vocab: int,
           session: np.ndarray | None, label_dtype: str) -> pa.Table:
    n = len(rows)
    dense = np.zeros((n, NUM_DENSE), dtype=np.float32)
    dense[:, 0] = rows
    dense[:, 1] = SPLIT_CODE.get(split, 9)
    dense[:, 2:] = np.log1p((rows[:, None] % 7) + np.arange(NUM_DENSE - 2))
    cols = {
        "label": pa.array((rows * 2654435761 % 7 < 3).astype(label_dtype)),
        "dense": pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), NUM_DENSE),
    }
    for k in range(1, onehot + 1):
        cols[f"C{k}"] = pa.array(onehot_ids(rows, k, vocab))
    for k in range(1, multihot + 1):
        lengths = rows % 4
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        bag_row = np.repeat(rows, lengths)
        pos = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
        values = ((bag_row + pos * k) % vocab).astype(np.int32)
        cols[f"H{k}"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    if session is not None:
        cols["session"] = pa.array(session.astype(np.int64))
    return pa.table(cols)


def write_dataset(
    tmp_path: str | os.PathLike,
    splits: dict[str, int] | None = None,
    *,
    onehot: int = 3,
    multihot: int = 0,
    vocab: int = 1000,
    row_group_size: int = 100,
    shard_rows: int = 350,
    sessions: bool = False,
    label_dtype: str = "float32",
    seed: int = 0,
    name: str = "data",
) -> Path:
    """Write shards + manifest.json under tmp_path/name and return that directory."""
    splits = {"train": 1000} if splits is None else splits
    out = Path(tmp_path) / name
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    features = [SparseFeature(f"C{k}", vocab) for k in range(1, onehot + 1)]
    features += [SparseFeature(f"H{k}", vocab, multi_hot=True) for k in range(1, multihot + 1)]
    manifest_splits = {}
    for split, n in splits.items():
        rows = np.arange(n, dtype=np.int64)
        session = None
        if sessions:
            session = np.repeat(np.arange(n), rng.integers(1, 6, size=n))[:n]
        # row-group boundaries (at session boundaries when there are sessions)
        cuts = list(range(row_group_size, n, row_group_size))
        if session is not None:
            cuts = sorted({c for c in (int(np.searchsorted(session, session[c])) for c in cuts) if 0 < c < n})
        bounds = [0, *cuts, n]
        groups = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]
        shards, current, rows_in = [], [], 0
        for g in groups:
            current.append(g)
            rows_in += g[1] - g[0]
            if rows_in >= shard_rows:
                shards.append(current)
                current, rows_in = [], 0
        if current:
            shards.append(current)
        entries = []
        for i, shard_groups in enumerate(shards):
            file = f"{split}-{i:05d}.parquet"
            writer = None
            for a, b in shard_groups:
                t = _table(rows[a:b], split, onehot, multihot, vocab,
                           None if session is None else session[a:b], label_dtype)
                if writer is None:
                    writer = pq.ParquetWriter(out / file, t.schema)
                writer.write_table(t, row_group_size=b - a)
            writer.close()
            count = sum(b - a for a, b in shard_groups)
            entries.append(Shard(file=file, rows=count, sha256=sha256_file(out / file),
                                 bytes=(out / file).stat().st_size))
        manifest_splits[split] = Split(rows=n, shards=entries)
    Manifest(
        source="test",
        sparse_features=features,
        splits=manifest_splits,
        session_column="session" if sessions else None,
    ).save(out)
    return out
