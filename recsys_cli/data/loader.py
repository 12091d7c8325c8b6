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
* all rows concatenated into one sequence; global batch k is rows
  [k * batch_size, (k + 1) * batch_size) of the sequence (across row-group
  boundaries). ``drop_last`` drops a final partial batch.

Rank r of world_size w gets a contiguous slice of every global batch; slice sizes
differ by at most one, and the first ``batch % w`` ranks get the larger ones.
(With ``drop_last=False`` the final, smaller batch may leave some ranks an empty
slice, so that every rank still yields the same number of batches.)

Position: ``state_dict()`` is the (epoch, batch) of the next batch the consumer
will receive. Because every row group's permutation has its own seed, resuming
at batch k only decodes the row groups that hold rows of batch k and later;
the skipped ones are located from parquet metadata row counts.

The pieces, one concept a module: row_groups.py finds, checks, reads and
permutes the row groups (each decoded once, batches are sliced out of it);
reader_dedup.py deduplicates (``dedup=True``); data_tools/background.py runs
this module's batch generator on the loader thread, ``queue_depth`` batches ahead.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Callable, Iterator, cast

import numpy as np
import pyarrow.parquet as pq
import torch

from data_tools.background import BackgroundIterator
from data_tools.manifest import Manifest, load_manifest
from recsys_cli.data.batch import Batch
from recsys_cli.data.jagged import KeyedJaggedTensor
from recsys_cli.data.reader_dedup import dedup_batch
from recsys_cli.data.row_groups import DecodedRowGroup, RowGroupReader, seeded_rng

__all__ = ["ShardLoader"]

# With the OpenMP backend the intra-op thread count is per calling thread: the
# loader thread runs its torch ops (dedup, transforms) single-threaded, so it
# does not fight the trainer's intra-op threads for the cores (on 2 busy cores
# a parallel region that has to wait for a descheduled thread costs
# milliseconds per op). Other backends share one setting: leave it alone.
_PER_THREAD_TORCH_THREADS = "parallel backend: OpenMP" in torch.__config__.parallel_info()


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
        self._reader = RowGroupReader(self.dataset_dir, m, split, features, keep_sessions=keep_sessions,
                                      bag_runs=dedup)
        self._multi_hot = self._reader.multi_hot
        self._onehot_keys = self._reader.onehot_keys
        self._multi_keys = self._reader.multi_keys
        self._session_col = m.session_column
        self._rg_rows = self._reader.rows
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

    # -- epoch plan -----------------------------------------------------
    def _row_group_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self._rg_rows))
        return seeded_rng(self.seed, epoch, 0).permutation(len(self._rg_rows))

    def _rank_slice(self, size: int) -> tuple[int, int]:
        base, rem = divmod(size, self.world_size)
        lo = self.rank * base + min(self.rank, rem)
        return lo, lo + base + (1 if self.rank < rem else 0)

    def _decode(self, files: dict, epoch: int, g: int) -> DecodedRowGroup:
        """Row group g, permuted by its own generator (seed, epoch, row group)."""
        return self._reader.decode(files, g, seeded_rng(self.seed, epoch, 1, g) if self.shuffle else None)

    def _assemble(self, pieces: list[tuple[DecodedRowGroup, int, int]]) -> Batch:
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
            sessions = [cast(np.ndarray, c.session)[a:b] for c, a, b in pieces]  # every chunk has one here
            session = torch.from_numpy(cat(sessions, np.zeros(0, np.int64)))
        B = len(labels)
        F = len(self.features)
        if self.dedup:
            deduplicated = dedup_batch(pieces, self.features, self._multi_keys, self._onehot_keys, B)
            return Batch(dense=torch.from_numpy(dense), sparse=deduplicated, labels=torch.from_numpy(labels),
                         session=session)
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
                        bag = c.multi[k]
                        assert isinstance(bag, tuple), "bag runs come only with dedup (returned above)"
                        off, vals = bag
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
        cache: dict[int, DecodedRowGroup] = {}
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
