"""The passes of `recsys preprocess criteo` (data_tools/criteo.py says what they compute).

* vocabulary mode: pass 1 counts every value (U32Map per feature) and, with
  spill, keeps the parsed rows with first-seen value indices in an Arrow file;
  the vocabulary is built from the counts; pass 2 assigns ids and writes the
  shards, from the spill file or by parsing the input again.
* mapped mode (hashing, or a saved vocabulary): one pass that maps and stages
  rows in file order, then moves (or, across a split boundary, rewrites) the
  staged files into their splits, whose boundaries are known only at the end.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_tools import shards as sh
from data_tools import vocab as vocab_io
from data_tools.criteo_config import ALL_SPLIT, CriteoConfig
from data_tools.criteo_days import terabyte_ranges
from data_tools.criteo_input import BlockReader
from data_tools.criteo_text import NUM_SPARSE, DecodedBlock
from data_tools.criteo_workers import Encoding, ParseJob, default_workers, parsed_blocks, scatter
from data_tools.spilled_counts import SpilledCounts
from data_tools.errors import UserError
from data_tools.manifest import CRITEO_SPARSE, NUM_DENSE, SPLITS, SparseFeature, Split
from data_tools.u32map import U32Map


def _ranges(cfg: CriteoConfig, total: int, file_rows: list[int]) -> list[tuple[str, int, int]]:
    if cfg.split_by == "none":
        return [(ALL_SPLIT, 0, total)]
    if cfg.split_by == "terabyte":
        return terabyte_ranges(file_rows)
    return sh.kaggle_ranges(total) if cfg.split_by == "kaggle" else sh.ratio_ranges(total, cfg.split_ratios)


def _job(cfg: CriteoConfig, paths, want_dense: bool, known_bad=None, encoding: Encoding | None = None) -> ParseJob:
    return ParseJob(tuple(str(p) for p in paths), labels=cfg.labels, label_int8=cfg.label_dtype == "int8",
                    block_size=cfg.block_size, on_error=cfg.on_error, want_dense=want_dense, known_bad=known_bad,
                    encoding=encoding)


# workers=0 on an input smaller than this: one process (starting workers, about
# a second, costs more than it saves)
SMALL_INPUT_BYTES = 64 << 20


def _workers(cfg: CriteoConfig, paths) -> int:
    if cfg.workers:
        return cfg.workers
    return 1 if sum(Path(p).stat().st_size for p in paths) < SMALL_INPUT_BYTES else default_workers()


def assign_ids(keys: np.ndarray, counts: np.ndarray, min_count: int, max_vocab: int | None):
    """(indices of the values that get an id, their ids): ids 1.. by
    descending count, ties by ascending value; past max_vocab, ids fold
    onto 1 + (id - 1) % (max_vocab - 1)."""
    keep = np.flatnonzero(counts >= min_count)
    keep = keep[np.lexsort((keys[keep], -counts[keep]))]
    ids = np.arange(1, len(keep) + 1, dtype=np.int64)
    if max_vocab is not None:
        ids = 1 + (ids - 1) % (max_vocab - 1)
    return keep, ids.astype(np.int32)


def vocabulary_mode(cfg: CriteoConfig, reader: BlockReader, paths, tmp: Path, progress, timings, t0):
    """Pass 1 counts values (and, with spill, keeps the parsed rows in an
    Arrow file); pass 2 assigns ids and writes the shards, from the spill
    file or by parsing the input again. With memory_budget the counts spill
    to partition files (spilled_counts.py) and the spill keeps raw values."""
    label_type = np.int8 if cfg.label_dtype == "int8" else np.float32
    spill_path = tmp / "_spill.arrow"
    bounded = cfg.memory_budget is not None
    maps = [U32Map(track_order=cfg.spill) for _ in range(NUM_SPARSE)] if not bounded else []
    # a quarter of the budget for the maps between flushes: a flush copies them, the partition files'
    # aggregation and the parse pipeline take the rest
    counter = SpilledCounts(tmp / "_counts", NUM_SPARSE, int(cfg.memory_budget) // 4) if bounded else None
    total = skipped = 0
    file_rows = [0] * len(paths)
    known_bad: dict[int, list[int]] = {}
    upd = progress.task("pass 1/2 count")
    spill = None
    try:
        for ch in parsed_blocks(_job(cfg, paths, want_dense=cfg.spill), _workers(cfg, paths)):
            d = ch.decoded
            assert d is not None
            if cfg.spill and spill is None and d.rows:
                _check_spill_space(tmp, d.rows / max(ch.bytes_read, 1) * progress.total)
            if counter is not None:
                for f in range(NUM_SPARSE):
                    counter.count(f, d.values[f])
                counter.maybe_flush()
                if cfg.spill and d.rows:
                    # raw values, null where missing: pass 2 maps them with the saved vocabulary
                    batch = _spill_batch(d, [_raw_column(d.present[f], d.values[f]) for f in range(NUM_SPARSE)],
                                         label_type)
                    if spill is None:
                        spill = pa.ipc.new_stream(pa.OSFile(str(spill_path), "wb"), batch.schema)
                    spill.write_batch(batch)
            elif cfg.spill:
                # 0 = missing, i + 1 = the value first seen i-th
                cols = [pa.array(scatter(d.present[f], maps[f].count(d.values[f]) + 1)) for f in range(NUM_SPARSE)]
                if d.rows:
                    batch = _spill_batch(d, cols, label_type)
                    if spill is None:
                        spill = pa.ipc.new_stream(pa.OSFile(str(spill_path), "wb"), batch.schema)
                    spill.write_batch(batch)
            else:
                for f in range(NUM_SPARSE):
                    maps[f].count(d.values[f])
            total += d.rows
            file_rows[ch.file_index] += d.rows
            skipped += ch.skipped
            if ch.first_skipped is not None and reader.first_skipped is None:
                reader.first_skipped = ch.first_skipped
            if ch.bad_lines:
                known_bad.setdefault(ch.file_index, []).extend(ch.first_line + i for i in ch.bad_lines)
            upd(total, ch.bytes_read)
    finally:
        if spill is not None:
            spill.close()
        if counter is not None:
            counter.close()
    if total == 0:
        raise reader.no_valid_rows()
    # ---- the vocabulary: frequent values by descending count, ties by value
    lookups, vocab, distinct = [], [], {}
    mapping_values, mapping_ids = [], []
    if counter is not None:
        for f, keys, counts, n_distinct in counter.frequent(cfg.min_count):
            distinct[CRITEO_SPARSE[f]] = n_distinct
            keep, ids = assign_ids(keys, counts, cfg.min_count, cfg.max_vocab)
            sorted_values, sorted_ids = vocab_io.sorted_mapping(keys[keep], ids)
            mapping_values.append(sorted_values)
            mapping_ids.append(sorted_ids)
            vocab.append(min(len(keep) + 1, cfg.max_vocab or len(keep) + 1))
    for f, m in enumerate(maps):
        if cfg.spill:
            keys, counts, first_seen = m.items_order()
        else:
            keys, counts = m.items()
        distinct[CRITEO_SPARSE[f]] = int(len(keys))
        keep, ids = assign_ids(keys, counts, cfg.min_count, cfg.max_vocab)
        sorted_values, sorted_ids = vocab_io.sorted_mapping(keys[keep], ids)
        mapping_values.append(sorted_values)
        mapping_ids.append(sorted_ids)
        if cfg.spill:
            remap = np.zeros(len(keys) + 1, dtype=np.int32)  # first-seen index + 1 -> id
            remap[first_seen[keep].astype(np.int64) + 1] = ids
            lookups.append(remap)
        vocab.append(min(len(keep) + 1, cfg.max_vocab or len(keep) + 1))
        maps[f] = None  # free the counts
    del maps
    vocab_entry = vocab_io.write_vocabulary(tmp, CRITEO_SPARSE, mapping_values, mapping_ids,
                                           {"mode": "vocabulary", "min_count": cfg.min_count,
                                            **({"max_vocab": cfg.max_vocab} if cfg.max_vocab else {})})
    del mapping_values, mapping_ids
    features = [SparseFeature(n, v) for n, v in zip(CRITEO_SPARSE, vocab)]
    schema = sh.shard_schema(features, label_type=pa.from_numpy_dtype(label_type))
    timings["pass 1"] = time.perf_counter() - t0
    # ---- pass 2: ids and shards
    writer = sh.SplitWriter(tmp, schema, _ranges(cfg, total, file_rows), cfg.row_group_rows, cfg.shard_rows,
                            cfg.compression)
    upd = progress.task("pass 2/2 write")
    written = 0
    try:
        if cfg.spill:
            saved = vocab_io.read_mapping(tmp, CRITEO_SPARSE) if counter is not None else None
            with pa.OSFile(str(spill_path), "rb") as f:
                for batch in pa.ipc.open_stream(f):
                    cols = [batch.column(0), batch.column(1)]
                    for k in range(NUM_SPARSE):
                        col = batch.column(2 + k)
                        if saved is not None:
                            present = col.is_valid().to_numpy(zero_copy_only=False)
                            values = col.fill_null(0).to_numpy()
                            cols.append(pa.array(scatter(present, saved.lookup(k, values[present]))))
                        else:
                            cols.append(pa.array(lookups[k][col.to_numpy()]))
                    writer.write(pa.Table.from_arrays(cols, schema=schema))
                    written += batch.num_rows
                    upd(written, int(progress.total * written / total))
            spill_path.unlink()
        else:
            encoding = Encoding(vocab_dir=str(tmp), label_type=np.dtype(label_type).name)
            for ch in parsed_blocks(_job(cfg, paths, True, known_bad, encoding), _workers(cfg, paths)):
                assert ch.table is not None
                writer.write(ch.table.cast(schema))
                written += ch.rows
                upd(written, ch.bytes_read)
        splits = writer.close()
    except BaseException:
        writer.abort()
        raise
    if written != total:
        raise UserError(f"input changed while it was being preprocessed ({total} rows, then {written})")
    return features, splits, skipped, distinct, vocab_entry


SPILL_BYTES_PER_ROW = 4 + 4 * NUM_DENSE + 4 * NUM_SPARSE  # label, dense, one int32 index per sparse value


def _check_spill_space(tmp: Path, rows: float) -> None:
    """Before the first spill write: the spill of every row (estimated from
    the first block's rows per input byte) must fit the free space."""
    need = int(rows * SPILL_BYTES_PER_ROW)
    free = shutil.disk_usage(tmp).free
    if need > free:
        raise UserError(
            f"pass 1 spills about {need / 1e9:.1f} GB ({rows:,.0f} rows x {SPILL_BYTES_PER_ROW} bytes) to {tmp}, "
            f"but only {free / 1e9:.1f} GB are free there; free space or give spill=false (parses the input twice)"
        )


def _raw_column(present: np.ndarray, values: np.ndarray) -> pa.Array:
    """A feature's raw uint32 values of every row, null where missing."""
    full = np.zeros(len(present), dtype=np.uint32)
    full[present] = values
    return pa.array(full, mask=~present)


def _spill_batch(d: DecodedBlock, cols: list[pa.Array], label_type) -> pa.RecordBatch:
    arrays = [pa.array(d.label.astype(label_type, copy=False)), sh.dense_array(d.dense)]
    arrays += cols
    return pa.RecordBatch.from_arrays(arrays, names=["label", "dense", *CRITEO_SPARSE])


def mapped_mode(cfg: CriteoConfig, reader: BlockReader, paths, tmp: Path, progress, vocabulary, features):
    """One pass with a known mapping (hashing, or a saved vocabulary): rows
    are mapped and staged in file order, then moved into their splits (the
    row count, hence the split boundaries, is known only at the end).
    Returns (splits, skipped lines, per feature the present values mapped to 0
    because the vocabulary has no id for them)."""
    label_type = "int8" if cfg.label_dtype == "int8" else "float32"
    schema = sh.shard_schema(features, label_type=pa.from_numpy_dtype(np.dtype(label_type)) if cfg.labels else None)
    staging = sh.ShardWriter(tmp, "_staging", schema, cfg.row_group_rows, cfg.shard_rows, cfg.compression)
    upd = progress.task("pass 1/1 hash" if vocabulary.mode == "hash" else "pass 1/1 map")
    total = skipped = 0
    file_rows = [0] * len(paths)
    unseen = np.zeros(NUM_SPARSE, dtype=np.int64)
    if vocabulary.mode == "hash":
        encoding = Encoding(hash_buckets=vocabulary.hash_buckets, label_type=label_type)
    else:
        encoding = Encoding(vocab_dir=str(vocabulary.directory), label_type=label_type)
    try:
        for ch in parsed_blocks(_job(cfg, paths, True, encoding=encoding), _workers(cfg, paths)):
            assert ch.table is not None and ch.unseen is not None
            unseen += ch.unseen
            staging.write(ch.table.cast(schema))
            total += ch.rows
            file_rows[ch.file_index] += ch.rows
            skipped += ch.skipped
            if ch.first_skipped is not None and reader.first_skipped is None:
                reader.first_skipped = ch.first_skipped
            upd(total, ch.bytes_read)
        staged = staging.close()
    except BaseException:
        staging.abort()
        raise
    if total == 0:
        raise reader.no_valid_rows()
    names = (ALL_SPLIT,) if cfg.split_by == "none" else SPLITS
    splits = _distribute(tmp, staged, schema, _ranges(cfg, total, file_rows), cfg, names)
    shutil.rmtree(tmp / "_staging", ignore_errors=True)
    return splits, skipped, unseen


def _distribute(tmp: Path, staged: Split, schema: pa.Schema, ranges, cfg: CriteoConfig,
                names=SPLITS) -> dict[str, Split]:
    """One-pass modes: move staged files into their split; rewrite the ones
    that straddle a split boundary."""
    writers = {s: sh.ShardWriter(tmp, s, schema, cfg.row_group_rows, cfg.shard_rows, cfg.compression) for s in names}
    pos = 0
    for shard in staged.shards:
        a, b = pos, pos + shard.rows
        pos = b
        parts = [(s, max(a, lo), min(b, hi)) for s, lo, hi in ranges if min(b, hi) > max(a, lo)]
        src = tmp / shard.file
        if len(parts) == 1:
            writers[parts[0][0]].add_file(src, shard)
            continue
        f = pq.ParquetFile(src)
        start = a  # global index of the row group's first row
        for g in range(f.metadata.num_row_groups):  # one row group in memory at a time
            group = f.read_row_group(g)
            end = start + group.num_rows
            for s, lo, hi in parts:
                lo, hi = max(lo, start), min(hi, end)
                if hi > lo:
                    writers[s].write(group.slice(lo - start, hi - lo))
            start = end
        f.close()
        src.unlink()
    return {s: w.close() for s, w in writers.items()}
