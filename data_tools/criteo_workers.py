"""Blocks of raw Criteo text parsed (and encoded) on every core, results in input order.

`parsed_blocks(job, workers)` is the one way the preprocessing passes get
their blocks. One thread reads (and gunzips) the input into blocks of whole
lines (criteo_input.text_blocks); each block is checked and decoded
(BlockReader.check), and, when the job says how, its values become ids and
the block an Arrow table in the shard schema (`encode_block`). With
workers=1 that runs on one background thread of this process; with more,
in that many worker processes (spawned: no forked copy of the caller's
threads), at most two blocks a worker in flight, so memory stays bounded
whatever the input's size; the blocks reach the workers through
shared-memory slots (block_slots.py), not pickled. The results come back in input order and each is
computed by the same function either way, so the shards are byte-identical
for every number of workers (tests/test_preprocess_scale.py).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data_tools import shards as sh
from data_tools import vocab as vocab_io
from data_tools.background import BackgroundIterator
from data_tools.block_slots import SLACK_BYTES, AttachedSlots, BlockSlots
from data_tools.criteo_input import BlockReader, TextBlock, text_blocks
from data_tools.criteo_text import NUM_SPARSE, DecodedBlock
from data_tools.manifest import CRITEO_SPARSE, SparseFeature

IN_FLIGHT_PER_WORKER = 2


@dataclass(frozen=True)
class Encoding:
    """How a block's values become ids: hashing (`hash_buckets`) or the
    mapping saved under `vocab_dir` (vocab/<feature>.values.npy and .ids.npy)."""

    hash_buckets: int | None = None
    vocab_dir: str | None = None
    label_type: str = "float32"  # float32 | int8


@dataclass(frozen=True)
class ParseJob:
    paths: tuple[str, ...]
    labels: bool = True
    label_int8: bool = False
    block_size: int = 8 << 20
    on_error: str = "raise"
    want_dense: bool = True
    known_bad: dict[int, list[int]] | None = None  # per file, the lines an earlier pass dropped
    encoding: Encoding | None = None  # None: the decoded values are the result


@dataclass
class BlockResult:
    rows: int
    skipped: int
    bad_lines: list[int]  # indices of the dropped lines within the block
    file_index: int
    first_line: int
    bytes_read: int
    first_skipped: tuple[Path, int, bytes] | None  # on_error=skip: the block's first dropped line
    decoded: DecodedBlock | None = None  # a job without an encoding
    table: pa.Table | None = None  # a job with one: the rows in the shard schema
    unseen: np.ndarray | None = None  # per feature, present values mapped to 0


def default_workers() -> int:
    """workers=0: one per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def shard_schema(labels: bool, label_type: str) -> pa.Schema:
    features = [SparseFeature(n, 0) for n in CRITEO_SPARSE]  # vocabulary sizes do not enter the schema
    return sh.shard_schema(features, label_type=pa.from_numpy_dtype(np.dtype(label_type)) if labels else None)


def scatter(present: np.ndarray, mapped: np.ndarray) -> np.ndarray:
    """Ids of every row: `mapped` where the value is present, 0 (missing) elsewhere."""
    out = np.zeros(len(present), dtype=np.int32)
    out[present] = mapped
    return out


def encode_block(d: DecodedBlock, vocabulary: vocab_io.Vocabulary, schema: pa.Schema,
                 label_type: str) -> tuple[pa.Table, np.ndarray]:
    """The block's rows in the shard schema, and per feature how many present
    values the vocabulary has no id for."""
    assert d.dense is not None, "an encoded block is parsed with want_dense"
    unseen = np.zeros(NUM_SPARSE, dtype=np.int64)
    cols = [] if d.label is None else [pa.array(d.label.astype(label_type, copy=False))]
    cols.append(sh.dense_array(d.dense))
    for f in range(NUM_SPARSE):
        mapped = vocabulary.lookup(f, d.values[f])
        unseen[f] = len(mapped) - np.count_nonzero(mapped)
        cols.append(pa.array(scatter(d.present[f], mapped)))
    return pa.Table.from_arrays(cols, schema=schema), unseen


def encoding_vocabulary(e: Encoding) -> vocab_io.Vocabulary:
    if e.hash_buckets is not None:
        return vocab_io.Vocabulary(CRITEO_SPARSE, "hash", hash_buckets=e.hash_buckets)
    assert e.vocab_dir is not None
    return vocab_io.read_mapping(Path(e.vocab_dir), CRITEO_SPARSE)


class _BlockWork:
    """What one process (the caller's, or a worker) does to each block."""

    def __init__(self, job: ParseJob):
        self.job = job
        self.reader = BlockReader([Path(p) for p in job.paths], labels=job.labels, label_int8=job.label_int8,
                                  block_size=job.block_size, on_error=job.on_error)
        self.vocabulary = self.schema = None
        if job.encoding is not None:
            self.vocabulary = encoding_vocabulary(job.encoding)
            self.schema = shard_schema(job.labels, job.encoding.label_type)

    def __call__(self, block: TextBlock) -> BlockResult:
        self.reader.first_skipped = None
        ch = self.reader.check(block, self.job.want_dense, self.job.known_bad)
        d = ch.decoded
        result = BlockResult(d.rows, ch.skipped, ch.bad_lines, block.file_index, block.first_line, block.bytes_read,
                             self.reader.first_skipped)
        if self.job.encoding is None:
            d.dense_raw = None  # the passes use the transformed dense values: not copied back from a worker
            result.decoded = d
        else:
            assert self.vocabulary is not None and self.schema is not None
            result.table, result.unseen = encode_block(d, self.vocabulary, self.schema, self.job.encoding.label_type)
        return result


_work: _BlockWork | None = None  # a worker process's
_slots: AttachedSlots | None = None


def _init_worker(job: ParseJob, slot_names: list[str], parent: int) -> None:
    global _work, _slots
    _exit_with(parent)
    _work = _BlockWork(job)
    _slots = AttachedSlots(slot_names)


PARENT_POLL_S = 0.5


def _exit_with(parent: int) -> None:
    """End this worker when `parent` (the preprocess that started it) is gone.
    A parent killed with SIGKILL never shuts its pool down, and the worker's
    wait for its next block never ends (each worker holds the write end of the
    pool's call queue itself, so it sees no end of file): the workers, about
    200 MB each, and multiprocessing's resource tracker stayed for good. A
    thread watches the parent's pid (reparented: another ppid) and exits.
    `parent` is the pid the parent gave, not getppid() here: a parent killed
    before this worker got this far has already been replaced."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="criteo-parent-watch", daemon=True).start()


def _run_in_worker(block: TextBlock, slot: int | None, nbytes: int) -> BlockResult:
    """`slot`: the block's text is in that shared-memory slot (`block.data`
    is empty); None: it came pickled in `block.data`."""
    assert _work is not None and _slots is not None
    if slot is not None:
        block = dataclasses.replace(block, data=_slots.read(slot, nbytes))
    return _work(block)


def parsed_blocks(job: ParseJob, workers: int) -> Iterator[BlockResult]:
    """Every block of the job's input, checked (and encoded), in input order."""
    paths = [Path(p) for p in job.paths]
    if workers <= 1:
        work = _BlockWork(job)
        with BackgroundIterator(text_blocks(paths, job.block_size), depth=2, name="criteo-read") as blocks, \
                BackgroundIterator(map(work, blocks), depth=2, name="criteo-parse") as results:
            yield from results
        return
    # On its own thread, so that the caller's work on each result (writing parquet, counting) overlaps
    # the reading, the copies into the slots and the hand-over to and from the workers: in one thread the
    # pipeline was serial there (a profile of the main thread: 25 of 37 s in parquet's write_table).
    with BackgroundIterator(_in_workers(job, workers, paths), depth=2, name="criteo-dispatch") as results:
        yield from results


def _in_workers(job: ParseJob, workers: int, paths: list[Path]) -> Iterator[BlockResult]:
    slots = BlockSlots(IN_FLIGHT_PER_WORKER * workers, job.block_size + SLACK_BYTES)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(job, slots.names, os.getpid()))
    inflight: deque[tuple[Future[BlockResult], int | None]] = deque()

    def oldest() -> BlockResult:
        future, slot = inflight.popleft()
        result = future.result()
        slots.release(slot)
        return result

    try:
        with BackgroundIterator(text_blocks(paths, job.block_size), depth=2, name="criteo-read") as blocks:
            for block in blocks:
                slot = slots.put(block.data)
                # no slot: bytes, not a view of the reader's buffer, as it is pickled to the worker
                sent = dataclasses.replace(block, data=b"" if slot is not None else bytes(block.data))
                inflight.append((pool.submit(_run_in_worker, sent, slot, len(block.data)), slot))
                if len(inflight) >= IN_FLIGHT_PER_WORKER * workers:
                    yield oldest()
        while inflight:
            yield oldest()
    finally:
        for f, _ in inflight:
            f.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        slots.close()
