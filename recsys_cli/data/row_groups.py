"""A split's row groups: found and checked against the manifest, then read,
decoded and permuted one at a time (on the loader thread).

Each row group is decoded once into numpy arrays (labels, dense [n, D], one-hot
ids as one int64 [F, n] block, multi-hot features as offsets + values, or as
bag runs with reader-side dedup), permuted once, and the loader slices its
batches out of it. Permutations come from generators seeded by what they
belong to (seed, epoch, row group), so any row group can be decoded alone: a
resumed epoch decodes only the row groups it still needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_tools.manifest import DENSE_COLUMN, LABEL_COLUMN, MANIFEST_NAME, Manifest, ManifestError, sha256_file
from recsys_cli.data.jagged import take_bags
from recsys_cli.data.reader_dedup import BagRuns, bag_runs

__all__ = ["DecodedRowGroup", "RowGroup", "RowGroupReader", "seeded_rng", "session_permutation"]


@dataclass(frozen=True)
class RowGroup:
    shard: int  # index into the split's shard files
    index: int  # row group inside that file
    rows: int


class DecodedRowGroup:
    """One decoded (and permuted) row group."""

    __slots__ = ("labels", "dense", "session", "onehot", "multi")

    def __init__(self, labels, dense, session, onehot, multi):
        self.labels: np.ndarray = labels  # float32 [n]
        self.dense: np.ndarray = dense  # float32 [n, D]
        self.session: np.ndarray | None = session  # int64 [n]
        self.onehot: np.ndarray = onehot  # int64 [F_onehot, n]
        # per multi-hot feature: (offsets [n+1], values), or BagRuns with reader-side dedup
        self.multi: list[BagRuns | tuple[np.ndarray, np.ndarray]] = multi


def seeded_rng(*entropy: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(e) & 0xFFFFFFFFFFFFFFFF for e in entropy]))


def session_permutation(session: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Row order that permutes the sessions (runs of equal ids), keeping each run in order."""
    n = len(session)
    if n == 0:
        return np.arange(0, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], session[1:] != session[:-1])))
    lens = np.diff(np.append(starts, n))
    order = rng.permutation(len(starts))
    lens_p = lens[order]
    out_start = np.zeros(len(order), dtype=np.int64)
    np.cumsum(lens_p[:-1], out=out_start[1:])
    idx = np.repeat(starts[order] - out_start, lens_p)
    idx += np.arange(n, dtype=np.int64)
    return idx


def _writable(a: np.ndarray) -> np.ndarray:
    return a if a.flags.writeable else a.copy()


class RowGroupReader:
    """The row groups of one split of a dataset directory, for `features`."""

    def __init__(self, dataset_dir: Path, manifest: Manifest, split: str, features: list[str], *,
                 keep_sessions: bool = False, bag_runs: bool = False) -> None:
        """keep_sessions: permute sessions, not rows; bag_runs: multi-hot
        features as runs of equal adjacent bags (reader-side dedup)."""
        self.dataset_dir = dataset_dir
        self.manifest = manifest
        self.split = split
        self.features = features
        self.keep_sessions = keep_sessions
        self.bag_runs = bag_runs
        self.multi_hot = {f: manifest.feature(f).multi_hot for f in features}
        self.vocab = {f: manifest.feature(f).vocab_size for f in features}
        self.onehot_keys = [f for f in features if not self.multi_hot[f]]
        self.multi_keys = [f for f in features if self.multi_hot[f]]
        self.session_column = manifest.session_column
        if keep_sessions and not self.session_column:
            raise ValueError(f"keep_sessions: the {split} split of {dataset_dir} has no session column")
        self._verified: set[int] = set()  # shards whose checksum was checked
        self.files, self.row_groups = self._scan_shards()
        self.rows = np.array([rg.rows for rg in self.row_groups], dtype=np.int64)

    # -- the scan (at construction) ---------------------------------------
    def _scan_shards(self) -> tuple[list[Path], list[RowGroup]]:
        split = self.manifest.splits[self.split]
        files, groups = [], []
        total = 0
        for i, shard in enumerate(split.shards):
            path = self.dataset_dir / shard.file
            if not path.is_file():
                raise ManifestError(f"{path}: shard listed in the manifest is missing")
            if shard.bytes is not None and path.stat().st_size != shard.bytes:
                raise ManifestError(
                    f"{path}: {path.stat().st_size} bytes, the manifest says {shard.bytes} (truncated or "
                    f"replaced; check the dataset with `recsys verify input={self.dataset_dir}`)"
                )
            try:
                meta = pq.read_metadata(path)
            except (OSError, pa.ArrowException) as e:
                raise ManifestError(f"{path}: not a readable parquet file ({e})") from None
            if meta.num_rows != shard.rows:
                raise ManifestError(f"{path}: {meta.num_rows} rows, the manifest says {shard.rows}")
            self._check_schema(path, meta.schema.to_arrow_schema())
            files.append(path)
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if n:
                    groups.append(RowGroup(i, g, n))
            total += meta.num_rows
        if total != split.rows:
            raise ManifestError(
                f"{self.dataset_dir}: split {self.split!r} shards hold {total} rows, the manifest says {split.rows}"
            )
        return files, groups

    def _check_schema(self, path: Path, schema: pa.Schema) -> None:
        def need(name: str, ok: Callable[[pa.DataType], bool], what: str) -> None:
            idx = schema.get_field_index(name)
            if idx < 0:
                raise ManifestError(f"{path}: column {name!r} missing")
            t = schema.field(idx).type
            if not ok(t):
                raise ManifestError(f"{path}: column {name!r} is {t}, expected {what}")

        if self.manifest.labelled:
            need(LABEL_COLUMN, lambda t: pa.types.is_floating(t) or pa.types.is_integer(t), "float32")
        dense_dim = len(self.manifest.dense_features)
        need(
            DENSE_COLUMN,
            lambda t: pa.types.is_fixed_size_list(t) and pa.types.is_floating(t.value_type) and t.list_size == dense_dim,
            f"fixed_size_list<float32>[{dense_dim}]",
        )
        for f in self.features:
            if self.multi_hot[f]:
                need(
                    f,
                    lambda t: (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type),
                    "list<int32> (multi-hot)",
                )
            else:
                need(f, pa.types.is_integer, "int32 (one-hot)")
        if self.session_column:
            need(self.session_column, pa.types.is_integer, "int64")

    # -- reading (on the loader thread) -----------------------------------
    def _verify(self, shard: int) -> None:
        """The shard's sha256 against the manifest, once per reader, when the
        shard is first read."""
        if shard in self._verified:
            return
        entry = self.manifest.splits[self.split].shards[shard]
        if entry.sha256 and sha256_file(self.files[shard]) != entry.sha256:
            raise ManifestError(
                f"{self.files[shard]}: sha256 differs from the manifest's (the shard is damaged; "
                f"check the dataset with `recsys verify input={self.dataset_dir}`, or preprocess it again)"
            )
        self._verified.add(shard)

    def _check_ids(self, rg: RowGroup, feature: str, ids: np.ndarray) -> None:
        """Every id of a row group's column must be a row of the feature's
        table: the tables are fused with row offsets, so an id past the end
        would silently read and train another table's rows. One min and max
        per column and row group, next to decoding it."""
        if not len(ids):
            return
        vocab = self.vocab[feature]
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            bad = hi if hi >= vocab else lo
            raise ManifestError(
                f"{self.files[rg.shard]}: row group {rg.index}, feature {feature}: id {bad} is outside "
                f"[0, {vocab}) (vocab_size {vocab} in {self.dataset_dir / MANIFEST_NAME})"
            )

    def decode(self, files: dict[int, pq.ParquetFile], g: int, rng: np.random.Generator | None) -> DecodedRowGroup:
        """Row group g, permuted by `rng` (None: file order). `files`: the
        pass's open ParquetFile, at most one: a shard is opened (and verified)
        when a row group of it is needed and the previous one is closed. An
        open ParquetFile keeps about 5 MiB of arrow buffers after its first
        read at the Kaggle profile, so keeping every shard of a shuffled epoch
        open grew RSS by about 200 MB over an epoch of 38 shards (issue 18,
        goal 7); reopening costs one footer read per row group."""
        rg = self.row_groups[g]
        path = self.files[rg.shard]
        labelled = self.manifest.labelled
        columns = [LABEL_COLUMN, DENSE_COLUMN, *self.features] if labelled else [DENSE_COLUMN, *self.features]
        if self.session_column:
            columns.append(self.session_column)
        try:
            pf = files.get(rg.shard)
            if pf is None:
                self._verify(rg.shard)
                for previous in files.values():
                    previous.close()
                files.clear()
                pf = files[rg.shard] = pq.ParquetFile(path)
            table = pf.read_row_group(rg.index, columns=columns)
        except (OSError, pa.ArrowException) as e:  # damaged after the manifest was written
            raise ManifestError(
                f"{path}: row group {rg.index} cannot be read ({str(e).splitlines()[0]}); the shard is damaged "
                f"(check the dataset with `recsys verify input={self.dataset_dir}`, or preprocess it again)"
            ) from None
        n = table.num_rows
        if n != rg.rows:
            raise ManifestError(f"{path}: row group {rg.index} has {n} rows, metadata says {rg.rows}")

        def col(name: str):
            c = table.column(name)
            return c.chunk(0) if c.num_chunks == 1 else c.combine_chunks()

        if labelled:
            labels = col(LABEL_COLUMN).to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        else:  # unlabelled data (labels=false at preprocessing): scored, never trained on
            labels = np.full(n, np.nan, dtype=np.float32)
        dense_arr = col(DENSE_COLUMN)
        dense = dense_arr.flatten().to_numpy(zero_copy_only=False)
        dense = dense.astype(np.float32, copy=False).reshape(n, dense_arr.type.list_size)
        session = None
        if self.session_column:
            session = col(self.session_column).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)

        perm = None
        if rng is not None:
            # keep_sessions comes with a session column (checked at construction)
            perm = session_permutation(session, rng) if self.keep_sessions and session is not None \
                else rng.permutation(n)

        onehot = np.empty((len(self.onehot_keys), n), dtype=np.int64)
        for j, f in enumerate(self.onehot_keys):
            ids = col(f).to_numpy(zero_copy_only=False)
            self._check_ids(rg, f, ids)
            onehot[j] = ids if perm is None else ids[perm]
        multi: list[BagRuns | tuple[np.ndarray, np.ndarray]] = []
        for f in self.multi_keys:
            arr = col(f)
            offsets = arr.offsets.to_numpy()
            values = arr.values.to_numpy(zero_copy_only=False)
            self._check_ids(rg, f, values[int(offsets[0]) : int(offsets[-1])])
            if self.bag_runs:
                multi.append(bag_runs(offsets, values, perm))
            elif perm is None:
                lo = int(offsets[0])
                multi.append((offsets.astype(np.int64) - lo, values[lo : int(offsets[-1])].astype(np.int64)))
            else:
                multi.append(take_bags(offsets, values, perm))
        if perm is None:
            labels, dense = _writable(labels), _writable(dense)
            session = None if session is None else _writable(session)
        else:
            labels, dense = labels[perm], dense[perm]
            session = None if session is None else session[perm]
        return DecodedRowGroup(labels, dense, session, onehot, multi)
