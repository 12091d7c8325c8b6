"""Shard writing shared by every dataset writer (Criteo preprocessing, synthetic data).

A dataset directory is built under `<output>.tmp-<pid>` next to the output and
renamed into place only after every shard and the manifest are written
(`dataset_dir.atomic_dataset_dir`). A killed run therefore leaves at most a `.tmp-<pid>`
directory (removed by the next run writing the same output), never something
with a manifest at the output path. Replacing an existing dataset replaces
only what its writer wrote (the files listed in its `.recsys-files.json`, or
its manifest and shards): anything else a user keeps in the directory stays.

`SplitWriter` routes rows (in order) to the train/val/test splits by global row
index and writes `<split>/part-NNNNN.parquet` files with exactly
`row_group_rows` rows per row group (the last of a split may be shorter) and
files of shard_rows rounded down to whole row groups. With a session column,
row groups end at session boundaries instead (at most row_group_rows rows,
unless one session is longer), so a loader that shuffles row groups keeps
sessions whole. Every file's sha256 is computed once it is
closed. The schema is the one data_tools.manifest documents.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_tools.errors import UserError
from data_tools.manifest import (
    DENSE_COLUMN,
    LABEL_COLUMN,
    NUM_DENSE,
    SESSION_COLUMN,
    SPLITS,
    Shard,
    SparseFeature,
    Split,
    sha256_file,
)

DEFAULT_ROW_GROUP_ROWS = 65536
DEFAULT_SHARD_ROWS = 1 << 20


# --------------------------------------------------------------------------- schema


def shard_schema(
    features: Sequence[SparseFeature], session: bool = False, label_type: pa.DataType | None = pa.float32()
) -> pa.Schema:
    """label_type None: no label column (unlabelled data)."""
    fields = [] if label_type is None else [pa.field(LABEL_COLUMN, label_type, nullable=False)]
    fields.append(pa.field(DENSE_COLUMN, pa.list_(pa.float32(), NUM_DENSE), nullable=False))
    for f in features:
        typ = pa.list_(pa.int32()) if f.multi_hot else pa.int32()
        fields.append(pa.field(f.name, typ, nullable=False))
    if session:
        fields.append(pa.field(SESSION_COLUMN, pa.int64(), nullable=False))
    return pa.schema(fields)


def dense_array(dense: np.ndarray) -> pa.FixedSizeListArray:
    """[n, 13] float32 -> fixed_size_list<float32>[13] (zero copy when contiguous)."""
    dense = np.ascontiguousarray(dense, dtype=np.float32)
    if dense.ndim != 2 or dense.shape[1] != NUM_DENSE:
        raise ValueError(f"dense must be [n, {NUM_DENSE}], got {dense.shape}")
    return pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), NUM_DENSE)


def multi_hot_array(offsets: np.ndarray, values: np.ndarray) -> pa.ListArray:
    """CSR (offsets int32 [n+1], values int32) -> list<int32>."""
    return pa.ListArray.from_arrays(
        pa.array(np.asarray(offsets, dtype=np.int32)), pa.array(np.asarray(values, dtype=np.int32))
    )


def make_table(
    schema: pa.Schema,
    label: np.ndarray,
    dense: np.ndarray,
    sparse: dict[str, np.ndarray | pa.Array],
    session: np.ndarray | None = None,
) -> pa.Table:
    """Build one table in `schema` from numpy columns (sparse: int32 arrays, or
    pyarrow list arrays for multi-hot features)."""
    cols: list[pa.Array] = [
        pa.array(np.asarray(label, dtype=schema.field(LABEL_COLUMN).type.to_pandas_dtype())),
        dense_array(dense),
    ]
    for field in schema:
        if field.name in (LABEL_COLUMN, DENSE_COLUMN, SESSION_COLUMN):
            continue
        v = sparse[field.name]
        cols.append(v if isinstance(v, pa.Array) else pa.array(np.asarray(v, dtype=np.int32)))
    if SESSION_COLUMN in schema.names:
        if session is None:
            raise ValueError("schema has a session column but no session ids were given")
        cols.append(pa.array(np.asarray(session, dtype=np.int64)))
    return pa.Table.from_arrays(cols, schema=schema)


# --------------------------------------------------------------------------- writing


class ShardWriter:
    """Writes one split's rows into part-NNNNN.parquet files under `directory`."""

    def __init__(
        self,
        root: Path,
        split: str,
        schema: pa.Schema,
        row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
        shard_rows: int = DEFAULT_SHARD_ROWS,
        compression: str = "snappy",
        session_column: str | None = None,
    ):
        if row_group_rows < 1:
            raise UserError(f"row_group_rows must be >= 1, got {row_group_rows}")
        self.root = Path(root)
        self.split = split
        self.schema = schema
        self.row_group_rows = int(row_group_rows)
        # A file holds a whole number of row groups.
        groups = max(1, int(shard_rows) // self.row_group_rows)
        self.shard_rows = groups * self.row_group_rows
        self.compression = compression
        self.session_column = session_column
        self.shards: list[Shard] = []
        self.rows = 0
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._file: Path | None = None
        self._file_rows = 0
        (self.root / split).mkdir(parents=True, exist_ok=True)

    def write(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        self._pending.append(table)
        self._pending_rows += table.num_rows
        if self._pending_rows >= self.row_group_rows:
            self._drain(final=False)

    def _drain(self, final: bool) -> None:
        if not self._pending_rows:
            return
        table = pa.concat_tables(self._pending) if len(self._pending) > 1 else self._pending[0]
        pos, n = 0, table.num_rows
        if self.session_column is not None:
            pos = self._drain_sessions(table, final)
        else:
            while n - pos >= self.row_group_rows or (final and pos < n):
                take = min(self.row_group_rows, n - pos)
                self._write_group(table.slice(pos, take))
                pos += take
        rest = table.slice(pos)
        self._pending = [rest] if rest.num_rows else []
        self._pending_rows = rest.num_rows

    def _drain_sessions(self, table: pa.Table, final: bool) -> int:
        """Row groups that end at session boundaries: each ends where the
        session holding its row_group_rows-th row starts (a session longer
        than a row group makes a longer group). Session ids must not decrease."""
        session = table.column(self.session_column).to_numpy()
        pos, n = 0, len(session)
        while pos < n:
            c = pos + self.row_group_rows
            if c < n:
                cut = pos + int(np.searchsorted(session[pos:], session[c], side="left"))
                if cut == pos:  # one session fills the group: end it with that session
                    cut = pos + int(np.searchsorted(session[pos:], session[c], side="right"))
                    if cut >= n and not final:
                        break
            elif final:
                cut = n
            else:
                break
            self._write_group(table.slice(pos, cut - pos))
            pos = cut
        return pos

    def _write_group(self, group: pa.Table) -> None:
        if self._writer is None:
            self._file = self.root / self.split / f"part-{len(self.shards):05d}.parquet"
            self._writer = pq.ParquetWriter(
                self._file, self.schema, compression=self.compression, use_dictionary=False
            )
            self._file_rows = 0
        # combine_chunks: one row group per call, whatever the input's chunking.
        self._writer.write_table(group.combine_chunks(), row_group_size=group.num_rows)
        self._file_rows += group.num_rows
        self.rows += group.num_rows
        if self._file_rows >= self.shard_rows:
            self._close_file()

    def _close_file(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        assert self._file is not None
        rel = self._file.relative_to(self.root).as_posix()
        self.shards.append(Shard(file=rel, rows=self._file_rows, sha256=sha256_file(self._file),
                                 bytes=self._file.stat().st_size))
        self._writer = None
        self._file = None

    def add_file(self, src: Path, shard: Shard) -> None:
        """Move an already written shard file (same schema) in as the next
        part, after flushing the rows written so far."""
        self._drain(final=True)
        self._close_file()
        dst = self.root / self.split / f"part-{len(self.shards):05d}.parquet"
        os.replace(src, dst)
        self.shards.append(Shard(file=dst.relative_to(self.root).as_posix(), rows=shard.rows, sha256=shard.sha256,
                                 bytes=dst.stat().st_size))
        self.rows += shard.rows

    def close(self) -> Split:
        self._drain(final=True)
        self._close_file()
        return Split(rows=self.rows, shards=list(self.shards))

    def abort(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None


class SplitWriter:
    """Routes rows, in global order, to the splits. `ranges` lists
    (split, start, end) row ranges covering [0, total) without overlap, e.g.
    [("train", 0, b0), ("val", b0, b1), ("test", b1, total)]. The splits are
    train, val and test, or the ones `ranges` names when it names another
    (split_by=none's one split, "all"). Splits with zero rows get no files but
    are in the result."""

    def __init__(
        self,
        root: Path,
        schema: pa.Schema,
        ranges: Sequence[tuple[str, int, int]] | None,
        row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
        shard_rows: int = DEFAULT_SHARD_ROWS,
        compression: str = "snappy",
        session_column: str | None = None,
    ):
        self.root = Path(root)
        self.schema = schema
        self.ranges = list(ranges) if ranges is not None else None
        named = list(dict.fromkeys(s for s, _, _ in self.ranges or ()))
        names = SPLITS if set(named) <= set(SPLITS) else named
        self.writers = {
            s: ShardWriter(self.root, s, schema, row_group_rows, shard_rows, compression, session_column)
            for s in names
        }
        self.position = 0

    def write(self, table: pa.Table) -> None:
        """Append rows; they are the next rows in global order."""
        if self.ranges is None:
            raise RuntimeError("SplitWriter without ranges: use write_split")
        n = table.num_rows
        start = self.position
        for split, lo_r, hi_r in self.ranges:
            lo = max(start, lo_r)
            hi = min(start + n, hi_r)
            if hi > lo:
                self.writers[split].write(table.slice(lo - start, hi - lo))
        self.position += n

    def write_split(self, split: str, table: pa.Table) -> None:
        self.writers[split].write(table)
        self.position += table.num_rows

    def close(self) -> dict[str, Split]:
        return {s: w.close() for s, w in self.writers.items()}

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()


def ratio_ranges(total: int, ratios: Sequence[float]) -> list[tuple[str, int, int]]:
    """train, val, test as consecutive row ranges with sizes proportional to
    `ratios` (normalised to sum 1; cut points rounded to the nearest row)."""
    r = [float(x) for x in ratios]
    if len(r) != 3 or any(not (x >= 0) for x in r) or sum(r) <= 0:
        raise UserError(
            f"split ratios must be three non-negative numbers (train, val, test), got {list(ratios)}"
        )
    s = sum(r)
    b0 = min(total, int(round(total * r[0] / s)))
    b1 = min(total, max(b0, int(round(total * (r[0] + r[1]) / s))))
    return [("train", 0, b0), ("val", b0, b1), ("test", b1, total)]


def kaggle_ranges(total: int, days: int = 7) -> list[tuple[str, int, int]]:
    """DLRM's Kaggle split (dlrm_data_pytorch): rows in file order cut into 7
    days of total // 7 rows, the first total % 7 days one row longer; train =
    days 0-5; the last day halved with numpy.array_split: its first half
    (the larger one when odd) is test, the second half val."""
    per, extra = divmod(total, days)
    sizes = [per + (1 if d < extra else 0) for d in range(days)]
    train = sum(sizes[:-1])
    last = sizes[-1]
    test = (last + 1) // 2
    return [("train", 0, train), ("test", train, train + test), ("val", train + test, total)]
