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
from data_tools.background import BackgroundIterator
from data_tools.criteo_config import ALL_SPLIT, CriteoConfig
from data_tools.criteo_input import BlockReader
from data_tools.criteo_text import NUM_SPARSE, DecodedBlock
from data_tools.errors import UserError
from data_tools.manifest import CRITEO_SPARSE, NUM_DENSE, SPLITS, SparseFeature, Split
from data_tools.u32map import U32Map


def _ranges(cfg: CriteoConfig, total: int) -> list[tuple[str, int, int]]:
    if cfg.split_by == "none":
        return [(ALL_SPLIT, 0, total)]
    return sh.kaggle_ranges(total) if cfg.split_by == "kaggle" else sh.ratio_ranges(total, cfg.split_ratios)


def _ids_table(schema: pa.Schema, d: DecodedBlock, ids: list[np.ndarray], label_type) -> pa.Table:
    cols = [] if d.label is None else [pa.array(d.label.astype(label_type, copy=False))]
    cols.append(sh.dense_array(d.dense))
    for f in range(NUM_SPARSE):
        cols.append(pa.array(ids[f]))
    return pa.Table.from_arrays(cols, schema=schema)


def _scatter(present: np.ndarray, mapped: np.ndarray) -> np.ndarray:
    out = np.zeros(len(present), dtype=np.int32)
    out[present] = mapped
    return out


def vocabulary_mode(cfg: CriteoConfig, reader: BlockReader, paths, tmp: Path, progress, timings, t0):
    """Pass 1 counts values (and, with spill, keeps the parsed rows with
    first-seen value indices in an Arrow file); pass 2 assigns ids and writes
    the shards, from the spill file or by parsing the input again."""
    label_type = np.int8 if cfg.label_dtype == "int8" else np.float32
    spill_path = tmp / "_spill.arrow"
    maps = [U32Map(track_order=cfg.spill) for _ in range(NUM_SPARSE)]
    total = skipped = 0
    known_bad: dict[int, list[int]] = {}
    upd = progress.task("pass 1/2 count")
    spill = None
    try:
        with BackgroundIterator(reader.chunks(want_dense=cfg.spill), name="criteo-parse") as chunks:
            for ch in chunks:
                d = ch.decoded
                if cfg.spill and spill is None and d.rows:
                    _check_spill_space(tmp, d.rows / max(ch.block.bytes_read, 1) * progress.total)
                if cfg.spill:
                    # 0 = missing, i + 1 = the value first seen i-th
                    cols = [_scatter(d.present[f], maps[f].count(d.values[f]) + 1) for f in range(NUM_SPARSE)]
                    if d.rows:
                        batch = _spill_batch(d, cols, label_type)
                        if spill is None:
                            spill = pa.ipc.new_stream(pa.OSFile(str(spill_path), "wb"), batch.schema)
                        spill.write_batch(batch)
                else:
                    for f in range(NUM_SPARSE):
                        maps[f].count(d.values[f])
                total += d.rows
                skipped += ch.skipped
                if ch.bad_lines:
                    known_bad.setdefault(ch.block.file_index, []).extend(ch.block.first_line + i for i in ch.bad_lines)
                upd(total, ch.block.bytes_read)
    finally:
        if spill is not None:
            spill.close()
    if total == 0:
        raise reader.no_valid_rows()
    # ---- the vocabulary: frequent values by descending count, ties by value
    lookups, vocab, distinct = [], [], {}
    mapping_values, mapping_ids = [], []
    for f, m in enumerate(maps):
        if cfg.spill:
            keys, counts, first_seen = m.items_order()
        else:
            keys, counts = m.items()
        distinct[CRITEO_SPARSE[f]] = int(len(keys))
        keep = np.flatnonzero(counts >= cfg.min_count)
        keep = keep[np.lexsort((keys[keep], -counts[keep]))]
        ids = np.arange(1, len(keep) + 1, dtype=np.int32)
        sorted_values, sorted_ids = vocab_io.sorted_mapping(keys[keep], ids)
        mapping_values.append(sorted_values)
        mapping_ids.append(sorted_ids)
        if cfg.spill:
            remap = np.zeros(len(keys) + 1, dtype=np.int32)  # first-seen index + 1 -> id
            remap[first_seen[keep].astype(np.int64) + 1] = ids
            lookups.append(remap)
        else:
            im = U32Map(capacity=int(len(keep) / U32Map.MAX_LOAD) + 16, dtype=np.int32)
            im.insert(keys[keep], ids)
            lookups.append(im)
        vocab.append(len(keep) + 1)
        maps[f] = None  # free the counts
    del maps
    vocab_entry = vocab_io.write_vocabulary(tmp, CRITEO_SPARSE, mapping_values, mapping_ids,
                                           {"mode": "vocabulary", "min_count": cfg.min_count})
    del mapping_values, mapping_ids
    features = [SparseFeature(n, v) for n, v in zip(CRITEO_SPARSE, vocab)]
    schema = sh.shard_schema(features, label_type=pa.from_numpy_dtype(label_type))
    timings["pass 1"] = time.perf_counter() - t0
    # ---- pass 2: ids and shards
    writer = sh.SplitWriter(tmp, schema, _ranges(cfg, total), cfg.row_group_rows, cfg.shard_rows, cfg.compression)
    upd = progress.task("pass 2/2 write")
    written = 0
    try:
        if cfg.spill:
            with pa.OSFile(str(spill_path), "rb") as f:
                for batch in pa.ipc.open_stream(f):
                    cols = [batch.column(0), batch.column(1)]
                    for k in range(NUM_SPARSE):
                        cols.append(pa.array(lookups[k][batch.column(2 + k).to_numpy()]))
                    writer.write(pa.Table.from_arrays(cols, schema=schema))
                    written += batch.num_rows
                    upd(written, int(progress.total * written / total))
            spill_path.unlink()
        else:
            with BackgroundIterator(reader.chunks(want_dense=True, known_bad=known_bad), name="criteo-parse") as chunks:
                for ch in chunks:
                    d = ch.decoded
                    ids = [_scatter(d.present[f], lookups[f].get(d.values[f])) for f in range(NUM_SPARSE)]
                    writer.write(_ids_table(schema, d, ids, label_type))
                    written += d.rows
                    upd(written, ch.block.bytes_read)
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


def _spill_batch(d: DecodedBlock, cols: list[np.ndarray], label_type) -> pa.RecordBatch:
    arrays = [pa.array(d.label.astype(label_type, copy=False)), sh.dense_array(d.dense)]
    arrays += [pa.array(c) for c in cols]
    return pa.RecordBatch.from_arrays(arrays, names=["label", "dense", *CRITEO_SPARSE])


def mapped_mode(cfg: CriteoConfig, reader: BlockReader, paths, tmp: Path, progress, vocabulary, features):
    """One pass with a known mapping (hashing, or a saved vocabulary): rows
    are mapped and staged in file order, then moved into their splits (the
    row count, hence the split boundaries, is known only at the end).
    Returns (splits, skipped lines, per feature the present values mapped to 0
    because the vocabulary has no id for them)."""
    label_type = np.int8 if cfg.label_dtype == "int8" else np.float32
    schema = sh.shard_schema(features, label_type=pa.from_numpy_dtype(label_type) if cfg.labels else None)
    staging = sh.ShardWriter(tmp, "_staging", schema, cfg.row_group_rows, cfg.shard_rows, cfg.compression)
    upd = progress.task("pass 1/1 hash" if vocabulary.mode == "hash" else "pass 1/1 map")
    total = skipped = 0
    unseen = np.zeros(NUM_SPARSE, dtype=np.int64)
    try:
        with BackgroundIterator(reader.chunks(want_dense=True), name="criteo-parse") as chunks:
            for ch in chunks:
                d = ch.decoded
                ids = []
                for f in range(NUM_SPARSE):
                    mapped = vocabulary.lookup(f, d.values[f])
                    unseen[f] += len(mapped) - np.count_nonzero(mapped)
                    ids.append(_scatter(d.present[f], mapped))
                staging.write(_ids_table(schema, d, ids, label_type))
                total += d.rows
                skipped += ch.skipped
                upd(total, ch.block.bytes_read)
        staged = staging.close()
    except BaseException:
        staging.abort()
        raise
    if total == 0:
        raise reader.no_valid_rows()
    names = (ALL_SPLIT,) if cfg.split_by == "none" else SPLITS
    splits = _distribute(tmp, staged, schema, _ranges(cfg, total), cfg, names)
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
