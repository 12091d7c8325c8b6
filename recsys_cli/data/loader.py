"""ShardLoader: parquet shards -> Batch objects, read ahead on a background thread.

Order of an epoch (the same on every rank, so ranks need no communication):

* the row groups of the split, in file order, or (``shuffle=True``) permuted by
  a generator seeded with (seed, epoch);
* inside each row group, rows in file order, or permuted by a generator seeded
  with (seed, epoch, row group). With ``keep_sessions=True`` the row group is
  cut into sessions (maximal runs of one session id) and the sessions are
  permuted instead, so a session's samples stay contiguous and in order (a
  session that spans a row-group boundary is kept as two runs, one per row
  group; writers that want whole sessions end row groups at session bounds);
* all rows concatenated into one stream; global batch k is rows
  [k * batch_size, (k + 1) * batch_size) of the stream (across row-group
  boundaries). ``drop_last`` drops a final partial batch.

Rank r of world_size w gets a contiguous slice of every global batch; slice sizes
differ by at most one, and the first ``batch % w`` ranks get the larger ones.
(With ``drop_last=False`` the final, smaller batch may leave some ranks an empty
slice, so that every rank still yields the same number of batches.)

Position: ``state_dict()`` is the (epoch, batch) of the next batch the consumer
will receive. Because every row group's permutation has its own seed, resuming
at batch k only decodes the row groups that hold rows of batch k and later;
the skipped ones are located from parquet metadata row counts.

Each row group is decoded once into numpy arrays (labels, dense [n, 13], one-hot
ids as one int64 [F, n] block, multi-hot features as offsets + values), permuted
once, and batches are sliced out of it.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from data_tools.background import BackgroundIterator
from data_tools.manifest import (
    DENSE_COLUMN,
    LABEL_COLUMN,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    load_manifest,
    sha256_file,
)
from recsys_cli.data.batch import Batch
from recsys_cli.data.dedup import InverseKeyedJaggedTensor, dedup_kjt, repeats_previous
from recsys_cli.data.jagged import KeyedJaggedTensor

__all__ = ["ShardLoader"]

# With the OpenMP backend the intra-op thread count is per calling thread: the
# loader thread runs its torch ops (dedup, transforms) single-threaded, so it
# does not fight the trainer's intra-op threads for the cores (on 2 busy cores
# a parallel region that has to wait for a descheduled thread costs
# milliseconds per op). Other backends share one setting: leave it alone.
_PER_THREAD_TORCH_THREADS = "parallel backend: OpenMP" in torch.__config__.parallel_info()


@dataclass(frozen=True)
class _RowGroup:
    shard: int  # index into the split's shard files
    index: int  # row group inside that file
    rows: int


class _Chunk:
    """One decoded (and permuted) row group."""

    __slots__ = ("labels", "dense", "session", "onehot", "multi")

    def __init__(self, labels, dense, session, onehot, multi):
        self.labels: np.ndarray = labels  # float32 [n]
        self.dense: np.ndarray = dense  # float32 [n, D]
        self.session: np.ndarray | None = session  # int64 [n]
        self.onehot: np.ndarray = onehot  # int64 [F_onehot, n]
        self.multi: list[tuple[np.ndarray, np.ndarray]] = multi  # (offsets [n+1], values)


def _rng(*entropy: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(e) & 0xFFFFFFFFFFFFFFFF for e in entropy]))


def _jagged_take(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Select/permute the rows of a jagged array: (new offsets [len(rows)+1], new values)."""
    lengths = (offsets[1:] - offsets[:-1])[rows]
    new_off = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_off[1:])
    total = int(new_off[-1])
    idx = np.repeat(offsets[:-1][rows].astype(np.int64) - new_off[:-1], lengths)
    idx += np.arange(total, dtype=np.int64)
    return new_off, values[idx].astype(np.int64, copy=False)


def _bag_runs(offsets: np.ndarray, values: np.ndarray, perm: np.ndarray | None) -> "_Runs":
    """A multi-hot column as runs of equal adjacent bags (RecD's reader-side
    dedup): session-clustered shards store a session's shared history in
    adjacent rows, so one comparison with the previous row over the file
    order finds them, and everything after (permutation, batching, lookups)
    handles one bag per run instead of one per sample."""
    lo = int(offsets[0])
    offsets = offsets.astype(np.int64) - lo
    values = values[lo : lo + int(offsets[-1])]
    repeat = repeats_previous(values, np.diff(offsets))
    heads = np.flatnonzero(~repeat)
    run_of_row = np.cumsum(~repeat) - 1
    run_offsets, run_values = _jagged_take(offsets, values, heads)
    return _Runs(run_offsets, run_values, run_of_row if perm is None else run_of_row[perm])


class _Runs:
    """Bags of one multi-hot column, one per run of equal rows."""

    __slots__ = ("offsets", "values", "run_of_row")

    def __init__(self, offsets: np.ndarray, values: np.ndarray, run_of_row: np.ndarray) -> None:
        self.offsets, self.values, self.run_of_row = offsets, values, run_of_row


def _session_permutation(session: np.ndarray, rng: np.random.Generator) -> np.ndarray:
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


class ShardLoader:
    """Batches of one split of a preprocessed dataset directory (see module docstring)."""

    def __init__(
        self,
        dataset_dir: str | os.PathLike,
        split: str = "train",
        batch_size: int = 128,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
        queue_depth: int = 4,
        keep_sessions: bool = False,
        features: list[str] | None = None,
        transform: Callable[[Batch], Batch] | None = None,
        dedup: bool = False,
    ) -> None:
        self.dataset_dir = Path(dataset_dir)
        self.manifest: Manifest = load_manifest(self.dataset_dir)
        m = self.manifest
        if split not in m.splits:
            raise ValueError(f"split {split!r} not in {self.dataset_dir} (splits: {', '.join(m.splits) or 'none'})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < world_size:
            raise ValueError(f"global batch_size {batch_size} is smaller than world_size {world_size}")
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        available = m.feature_names
        if features is None:
            features = list(available)
        else:
            features = list(features)
            unknown = [f for f in features if f not in available]
            if unknown:
                raise ValueError(
                    f"unknown sparse feature(s) {', '.join(unknown)}; available: {', '.join(available)}"
                )
            dup = sorted({f for f in features if features.count(f) > 1})
            if dup:
                raise ValueError(f"sparse feature(s) listed twice: {', '.join(dup)}")
        if keep_sessions and not m.session_column:
            raise ValueError(f"keep_sessions=True but the dataset in {self.dataset_dir} has no session column")

        self.split = split
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.queue_depth = queue_depth
        self.keep_sessions = keep_sessions
        self.features = features
        self.transform = transform
        self.dedup = dedup
        self._multi_hot = {f: m.feature(f).multi_hot for f in features}
        self._vocab = {f: m.feature(f).vocab_size for f in features}
        self._onehot_keys = [f for f in features if not self._multi_hot[f]]
        self._multi_keys = [f for f in features if self._multi_hot[f]]
        self._session_col = m.session_column

        self._verified: set[int] = set()  # shards whose checksum was checked
        self._files, self._row_groups = self._scan_shards()
        self._rg_rows = np.array([rg.rows for rg in self._row_groups], dtype=np.int64)
        self.num_rows = int(self._rg_rows.sum())
        if self.num_rows == 0:
            raise ValueError(f"split {split!r} of {self.dataset_dir} has no rows")
        if drop_last:
            self.num_batches = self.num_rows // batch_size
            if self.num_batches == 0:
                raise ValueError(
                    f"split {split!r} has {self.num_rows} rows, fewer than one global batch of "
                    f"{batch_size} (lower the batch size or use drop_last=False)"
                )
        else:
            self.num_batches = -(-self.num_rows // batch_size)

        self._epoch = 0
        self._batch = 0
        self._active: weakref.ref | None = None

    # -- dataset scan ---------------------------------------------------
    def _scan_shards(self) -> tuple[list[Path], list[_RowGroup]]:
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
                    f"replaced; check the dataset with `recsys verify {self.dataset_dir}`)"
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
                    groups.append(_RowGroup(i, g, n))
            total += meta.num_rows
        if total != split.rows:
            raise ManifestError(
                f"{self.dataset_dir}: split {self.split!r} shards hold {total} rows, the manifest says {split.rows}"
            )
        return files, groups

    def _verify(self, shard: int) -> None:
        """The shard's sha256 against the manifest, once per loader, when the
        shard is first read (on the loader thread)."""
        if shard in self._verified:
            return
        entry = self.manifest.splits[self.split].shards[shard]
        if entry.sha256 and sha256_file(self._files[shard]) != entry.sha256:
            raise ManifestError(
                f"{self._files[shard]}: sha256 differs from the manifest's (the shard is damaged; "
                f"check the dataset with `recsys verify {self.dataset_dir}`, or preprocess it again)"
            )
        self._verified.add(shard)

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
            if self._multi_hot[f]:
                need(
                    f,
                    lambda t: (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type),
                    "list<int32> (multi-hot)",
                )
            else:
                need(f, pa.types.is_integer, "int32 (one-hot)")
        if self._session_col:
            need(self._session_col, pa.types.is_integer, "int64")

    # -- epoch plan -----------------------------------------------------
    def _row_group_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self._row_groups))
        return _rng(self.seed, epoch, 0).permutation(len(self._row_groups))

    def _rank_slice(self, size: int) -> tuple[int, int]:
        base, rem = divmod(size, self.world_size)
        lo = self.rank * base + min(self.rank, rem)
        return lo, lo + base + (1 if self.rank < rem else 0)

    def _check_ids(self, rg: _RowGroup, feature: str, ids: np.ndarray) -> None:
        """Every id of a row group's column must be a row of the feature's
        table: the tables are fused with row offsets, so an id past the end
        would silently read and train another table's rows. One min and max
        per column and row group, next to decoding it."""
        if not len(ids):
            return
        vocab = self._vocab[feature]
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            bad = hi if hi >= vocab else lo
            raise ManifestError(
                f"{self._files[rg.shard]}: row group {rg.index}, feature {feature}: id {bad} is outside "
                f"[0, {vocab}) (vocab_size {vocab} in {self.dataset_dir / MANIFEST_NAME})"
            )

    def _decode(self, files: dict, epoch: int, g: int) -> _Chunk:
        rg = self._row_groups[g]
        path = self._files[rg.shard]
        labelled = self.manifest.labelled
        columns = [LABEL_COLUMN, DENSE_COLUMN, *self.features] if labelled else [DENSE_COLUMN, *self.features]
        if self._session_col:
            columns.append(self._session_col)
        try:
            pf = files.get(rg.shard)
            if pf is None:
                self._verify(rg.shard)
                pf = files[rg.shard] = pq.ParquetFile(path)
            table = pf.read_row_group(rg.index, columns=columns)
        except (OSError, pa.ArrowException) as e:  # damaged after the manifest was written
            raise ManifestError(
                f"{path}: row group {rg.index} cannot be read ({str(e).splitlines()[0]}); the shard is damaged "
                f"(check the dataset with `recsys verify {self.dataset_dir}`, or preprocess it again)"
            ) from None
        n = table.num_rows
        if n != rg.rows:
            raise ManifestError(f"{self._files[rg.shard]}: row group {rg.index} has {n} rows, metadata says {rg.rows}")

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
        if self._session_col:
            session = col(self._session_col).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)

        perm = None
        if self.shuffle:
            rng = _rng(self.seed, epoch, 1, g)
            perm = _session_permutation(session, rng) if self.keep_sessions else rng.permutation(n)

        onehot = np.empty((len(self._onehot_keys), n), dtype=np.int64)
        for j, f in enumerate(self._onehot_keys):
            ids = col(f).to_numpy(zero_copy_only=False)
            self._check_ids(rg, f, ids)
            onehot[j] = ids if perm is None else ids[perm]
        multi = []
        for f in self._multi_keys:
            arr = col(f)
            offsets = arr.offsets.to_numpy()
            values = arr.values.to_numpy(zero_copy_only=False)
            self._check_ids(rg, f, values[int(offsets[0]) : int(offsets[-1])])
            if self.dedup:
                multi.append(_bag_runs(offsets, values, perm))
                continue
            if perm is None:
                lo = int(offsets[0])
                multi.append((offsets.astype(np.int64) - lo, values[lo : int(offsets[-1])].astype(np.int64)))
            else:
                multi.append(_jagged_take(offsets, values, perm))
        if perm is None:
            labels, dense = _writable(labels), _writable(dense)
            session = None if session is None else _writable(session)
        else:
            labels, dense = labels[perm], dense[perm]
            session = None if session is None else session[perm]
        return _Chunk(labels, dense, session, onehot, multi)

    def _assemble_dedup(self, pieces: list[tuple[_Chunk, int, int]], B: int) -> InverseKeyedJaggedTensor:
        """The batch's sparse part as an InverseKeyedJaggedTensor, built from
        the chunks' bag runs without expanding multi-hot bags per sample."""
        values, lengths, counts, inverse = [], [], [], []
        for f in self.features:
            if self._multi_hot[f]:
                k = self._multi_keys.index(f)
                runs = [(c.multi[k], c.multi[k].run_of_row[a:b]) for c, a, b in pieces]
                # Runs of different chunks are different bags: number them apart.
                base = np.cumsum([0] + [len(r.offsets) - 1 for r, _ in runs])
                ids = np.concatenate([rr + base[i] for i, (_, rr) in enumerate(runs)]) if runs else np.zeros(0, np.int64)
                uniq, inv = np.unique(ids, return_inverse=True)
                for i, (r, _) in enumerate(runs):
                    mine = uniq[(uniq >= base[i]) & (uniq < base[i + 1])] - base[i]
                    off, vals = _jagged_take(r.offsets, r.values, mine)
                    values.append(vals)
                    lengths.append(np.diff(off))
                counts.append(len(uniq))
                inverse.append(inv.reshape(-1))
            else:
                j = self._onehot_keys.index(f)
                ids = np.concatenate([c.onehot[j, a:b] for c, a, b in pieces]) if pieces else np.zeros(0, np.int64)
                uniq, inv = np.unique(ids, return_inverse=True)
                values.append(uniq.astype(np.int64))
                lengths.append(np.ones(len(uniq), np.int64))
                counts.append(len(uniq))
                inverse.append(inv.reshape(-1))
        return InverseKeyedJaggedTensor(
            keys=list(self.features),
            values=torch.from_numpy(np.concatenate(values) if values else np.zeros(0, np.int64)),
            lengths=torch.from_numpy(np.concatenate(lengths) if lengths else np.zeros(0, np.int64)),
            unique_counts=counts,
            inverse=torch.from_numpy(np.stack(inverse) if inverse else np.zeros((0, B), np.int64)).view(len(self.features), B),
            stride=B,
        )

    def _assemble(self, pieces: list[tuple[_Chunk, int, int]]) -> Batch:
        """A Batch from row ranges [a, b) of decoded chunks, in order."""

        def cat(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
            if len(parts) == 1:
                return parts[0]
            return np.concatenate(parts) if parts else empty

        labels = cat([c.labels[a:b] for c, a, b in pieces], np.zeros(0, np.float32))
        dense_dim = len(self.manifest.dense_features)
        dense = cat([c.dense[a:b] for c, a, b in pieces], np.zeros((0, dense_dim), np.float32))
        session = None
        if self._session_col:
            session = torch.from_numpy(cat([c.session[a:b] for c, a, b in pieces], np.zeros(0, np.int64)))
        B = len(labels)
        F = len(self.features)
        if self.dedup and self._multi_keys:
            return Batch(dense=torch.from_numpy(dense), sparse=self._assemble_dedup(pieces, B),
                         labels=torch.from_numpy(labels), session=session)
        if not self._multi_keys:
            if len(pieces) == 1:
                c, a, b = pieces[0]
                values = c.onehot[:, a:b].reshape(-1)
            elif pieces:
                values = np.concatenate([c.onehot[:, a:b] for c, a, b in pieces], axis=1).reshape(-1)
            else:
                values = np.zeros(0, np.int64)
            lengths = torch.ones(F * B, dtype=torch.int64)
        else:
            vparts, lparts = [], []
            for f in self.features:
                if self._multi_hot[f]:
                    k = self._multi_keys.index(f)
                    for c, a, b in pieces:
                        off, vals = c.multi[k]
                        vparts.append(vals[off[a] : off[b]])
                        lparts.append(np.diff(off[a : b + 1]))
                else:
                    j = self._onehot_keys.index(f)
                    vparts.extend(c.onehot[j, a:b] for c, a, b in pieces)
                    lparts.append(np.ones(B, np.int64))
            values = np.concatenate(vparts) if vparts else np.zeros(0, np.int64)
            lengths = torch.from_numpy(np.concatenate(lparts) if lparts else np.zeros(0, np.int64))
        sparse = KeyedJaggedTensor(
            keys=list(self.features), values=torch.from_numpy(values), lengths=lengths, stride=B
        )
        return Batch(
            dense=torch.from_numpy(dense),
            sparse=sparse,
            labels=torch.from_numpy(labels),
            session=session,
        )

    def _batches(self, epoch: int, start: int) -> Iterator[tuple[int, Batch]]:
        """(k, batch) for batches start.. of one epoch; runs on the loader thread."""
        if _PER_THREAD_TORCH_THREADS:
            torch.set_num_threads(1)
        files: dict[int, pq.ParquetFile] = {}
        order = self._row_group_order(epoch)
        rows = self._rg_rows[order]
        ends = np.cumsum(rows)
        starts = ends - rows
        G = len(order)
        cache: dict[int, _Chunk] = {}
        p = 0  # first row group that may still hold rows we need
        B, N = self.batch_size, self.num_rows
        for k in range(start, self.num_batches):
            g0 = k * B
            lo, hi = self._rank_slice(min(B, N - g0))
            s, e = g0 + lo, g0 + hi
            while p < G and ends[p] <= s:
                cache.pop(p, None)
                p += 1
            pieces = []
            q = p
            while e > s and q < G and starts[q] < e:
                chunk = cache.get(q)
                if chunk is None:
                    chunk = cache[q] = self._decode(files, epoch, int(order[q]))
                pieces.append((chunk, int(max(s, starts[q]) - starts[q]), int(min(e, ends[q]) - starts[q])))
                q += 1
            batch = self._assemble(pieces)
            if self.dedup and not self._multi_keys:  # multi-hot batches come deduplicated
                batch.sparse = dedup_kjt(batch.sparse)
            if self.transform is not None:
                batch = self.transform(batch)
            yield k, batch

    # -- public API -----------------------------------------------------
    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        prev = self._active() if self._active is not None else None
        if prev is not None:
            prev.close()
        it = _EpochIterator(self, self._epoch, self._batch)
        self._active = weakref.ref(it)
        return it

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "batch": self._batch,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_rows": self.num_rows,
            "shuffle": self.shuffle,
            "keep_sessions": self.keep_sessions,
            "drop_last": self.drop_last,
            "split": self.split,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("batch_size", "num_rows", "shuffle", "keep_sessions", "drop_last", "split"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state has {key}={state[key]!r}, this loader has {getattr(self, key)!r}: "
                    "the saved position does not apply"
                )
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if epoch < 0 or not 0 <= batch < self.num_batches:
            raise ValueError(f"loader state position (epoch {epoch}, batch {batch}) out of range")
        prev = self._active() if self._active is not None else None
        if prev is not None:
            prev.close()
        self.seed = int(state.get("seed", self.seed))
        self._epoch, self._batch = epoch, batch

    def set_epoch(self, epoch: int) -> None:
        """Start of ``epoch``; a no-op when already inside it (so a resumed position survives)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch, self._batch = epoch, 0

    @property
    def epoch(self) -> int:
        return self._epoch

    def _advance(self, k: int) -> None:
        if k + 1 >= self.num_batches:
            self._epoch, self._batch = self._epoch + 1, 0
        else:
            self._batch = k + 1


class _EpochIterator:
    """Consumer side of one epoch; closing it (or dropping it) stops the thread."""

    def __init__(self, loader: ShardLoader, epoch: int, start: int) -> None:
        self._loader = loader
        self._batches = BackgroundIterator(
            loader._batches(epoch, start), depth=loader.queue_depth, name=f"ShardLoader-{loader.split}-e{epoch}"
        )

    def __iter__(self) -> "_EpochIterator":
        return self

    def __next__(self) -> Batch:
        k, batch = next(self._batches)
        self._loader._advance(k)
        return batch

    def close(self) -> None:
        self._batches.close()

    def __enter__(self) -> "_EpochIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
