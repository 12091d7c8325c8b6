"""Issue 41 items 1-3: Criteo Terabyte's day files and split, MLPerf's cap,
counting in bounded memory, and worker processes whose output is
byte-identical to one process's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_tools import criteo_config
from data_tools.criteo import CriteoConfig, preprocess
from data_tools.manifest import CRITEO_SPARSE, load_manifest
from data_tools.spilled_counts import SpilledCounts
from data_tools.synthetic import (
    TERABYTE_CARDINALITIES,
    SyntheticConfig,
    day_rows,
    vocab_sizes,
    write_tsv,
    write_tsv_days,
)
from data_tools.u32map import U32Map
from data_tools.vocab import load_vocabulary
from recsys_cli.errors import UserError

# Kaggle-like vocabularies small enough that min_count=2 drops some values and keeps others.
SMALL = SyntheticConfig(rows=3001, cardinality_scale=0.0005, seed=3)


def run(tmp: Path, name: str, inputs, **options) -> Path:
    out = tmp / name
    preprocess(CriteoConfig(input=inputs, output=str(out), progress=False, **options))
    return out


def split_table(d: Path, split: str) -> pa.Table:
    m = load_manifest(d)
    tables = [pq.read_table(d / s.file) for s in m.splits[split].shards]
    return pa.concat_tables(tables) if tables else None


def shard_hashes(d: Path) -> dict[str, list[str]]:
    return {k: [s.sha256 for s in v.shards] for k, v in load_manifest(d).splits.items()}


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> list[Path]:
    return write_tsv_days(SMALL, tmp_path_factory.mktemp("days"), 3)


# --------------------------------------------------------------------------- item 1: days, split, profile, cap


def test_day_files_are_the_one_file_cut_into_days(tmp_path, days):
    one = write_tsv(SMALL, tmp_path / "all.txt")
    assert b"".join(p.read_bytes() for p in days) == one.read_bytes()
    assert [p.name for p in days] == ["day_0", "day_1", "day_2"]
    lines = [p.read_bytes().count(b"\n") for p in days]
    assert lines == [hi - lo for lo, hi in day_rows(SMALL.rows, 3)] == [1000, 1000, 1001]
    gz = write_tsv_days(SMALL, tmp_path / "gz", 3, gz=True)
    import gzip

    assert [p.name for p in gz] == ["day_0.gz", "day_1.gz", "day_2.gz"]
    assert [gzip.decompress(p.read_bytes()) for p in gz] == [p.read_bytes() for p in days]


def test_terabyte_profile_has_criteo_1tb_capped_cardinalities():
    assert vocab_sizes(SyntheticConfig(profile="terabyte", cardinality_scale=1.0)) == TERABYTE_CARDINALITIES
    assert sum(TERABYTE_CARDINALITIES) == 204_184_588
    small = vocab_sizes(SyntheticConfig(profile="terabyte", cardinality_scale=0.001))
    assert small[0] == 40_000 and small[5] == 3  # min(card, max(min_vocab, ceil(card * scale)))


def test_terabyte_split_is_days_then_the_last_day_halved(tmp_path, days):
    whole = run(tmp_path, "none", [str(p) for p in days], split_by="none", hash_buckets=1000)
    tb = run(tmp_path, "tb", str(days[0].parent / "day_*"), split_by="terabyte", hash_buckets=1000)
    all_rows = split_table(whole, "all")
    # dlrm's --data-set=terabyte: days 0..K-2 train; the last day's first ceil(n/2) rows test, the rest val
    assert split_table(tb, "train").equals(all_rows.slice(0, 2000))
    assert split_table(tb, "test").equals(all_rows.slice(2000, 501))
    assert split_table(tb, "val").equals(all_rows.slice(2501, 500))
    m = load_manifest(tb)
    assert m.options["terabyte_days"] == 3
    # vocabulary mode cuts at the same rows
    vocab = run(tmp_path, "tbv", [str(p) for p in days], split_by="terabyte")
    assert {k: v.rows for k, v in load_manifest(vocab).splits.items()} == {"train": 2000, "test": 501, "val": 500}


def test_terabyte_split_refuses_files_that_are_not_days_0_to_k(tmp_path, days):
    with pytest.raises(UserError, match=r"split_by=terabyte needs the days 0 \.\. K-1 in order.*day_2, is day 2, "
                                        r"expected day 1"):
        run(tmp_path, "x", [str(days[0]), str(days[2])], split_by="terabyte", hash_buckets=10)
    with pytest.raises(UserError, match="needs 2 .. 24 day files"):
        run(tmp_path, "x", [str(days[0])], split_by="terabyte", hash_buckets=10)
    odd = tmp_path / "train.txt"
    odd.write_bytes(days[0].read_bytes())
    with pytest.raises(UserError, match="has no day number in its name"):
        run(tmp_path, "x", [str(odd)], split_by="terabyte", hash_buckets=10)
    assert not (tmp_path / "x").exists()


def test_max_vocab_folds_ids_past_the_cap(tmp_path, days):
    inputs = [str(p) for p in days]
    full = run(tmp_path, "full", inputs, split_by="none")
    capped = run(tmp_path, "capped", inputs, split_by="none", max_vocab=7)
    a, b = split_table(full, "all"), split_table(capped, "all")
    for name in CRITEO_SPARSE:
        ids = a.column(name).to_numpy()
        # MLPerf's contiguous id modulo its cap, with id 0 kept for missing values
        expect = np.where(ids > 0, 1 + (ids - 1) % 6, 0)
        assert np.array_equal(b.column(name).to_numpy(), expect), name
    sizes = {f.name: f.vocab_size for f in load_manifest(capped).sparse_features}
    full_sizes = {f.name: f.vocab_size for f in load_manifest(full).sparse_features}
    assert sizes == {k: min(v, 7) for k, v in full_sizes.items()}


# --------------------------------------------------------------------------- item 2: counting in bounded memory


def test_spilled_counts_equal_a_counter():
    rng = np.random.default_rng(0)
    features = 3
    counts = SpilledCounts(Path(__import__("tempfile").mkdtemp()), features, budget=1)  # flush after every add
    seen = [[] for _ in range(features)]
    for _ in range(7):
        for f in range(features):
            v = (rng.zipf(1.3, 500) * 2654435761 % 2**32).astype(np.uint32)
            counts.count(f, v)
            seen[f].append(v)
        counts.maybe_flush()
    assert counts.flushes == 7
    for f, keys, got, distinct in counts.frequent(min_count=2):
        want_keys, want_counts = np.unique(np.concatenate(seen[f]), return_counts=True)
        assert distinct == len(want_keys)
        order = np.argsort(keys)
        keep = want_counts >= 2
        assert np.array_equal(keys[order], want_keys[keep])
        assert np.array_equal(got[order], want_counts[keep])


@pytest.mark.parametrize("spill", [True, False])
def test_bounded_count_gives_the_in_memory_ids(tmp_path, days, monkeypatch, spill):
    inputs = [str(p) for p in days]
    memory = run(tmp_path, "memory", inputs, min_count=2, spill=spill)
    flushes = []
    real_flush = SpilledCounts.flush

    def counting_flush(self):
        flushes.append(1)
        real_flush(self)

    monkeypatch.setattr(SpilledCounts, "flush", counting_flush)
    monkeypatch.setattr(criteo_config, "MIN_MEMORY_BUDGET", 0)
    bounded = run(tmp_path, "bounded", inputs, min_count=2, spill=spill, memory_budget=4, block_size=16384)
    assert len(flushes) > 5  # the counts went through the partition files many times
    for split in ("train", "val", "test"):
        a, b = split_table(memory, split), split_table(bounded, split)
        for name in a.column_names:
            assert np.array_equal(np.stack(a.column(name).to_numpy(zero_copy_only=False)),
                                  np.stack(b.column(name).to_numpy(zero_copy_only=False))), (split, name)
    va, vb = load_vocabulary(memory), load_vocabulary(bounded)
    for ta, tb in zip(va.tables, vb.tables):
        assert np.array_equal(ta.values, tb.values) and np.array_equal(ta.ids, tb.ids)
    ma, mb = load_manifest(memory), load_manifest(bounded)
    assert ma.options["distinct_values"] == mb.options["distinct_values"]
    assert 1 < min(f.vocab_size for f in ma.sparse_features)  # min_count=2 kept values...
    assert any(ma.options["distinct_values"][f.name] > f.vocab_size - 1 for f in ma.sparse_features)  # ...and dropped some
    assert not list(bounded.parent.glob("bounded.tmp-*"))
    assert sorted(p.name for p in bounded.iterdir()) == sorted(p.name for p in memory.iterdir())  # no _counts left


def test_memory_budget_is_checked(tmp_path, days):
    with pytest.raises(UserError, match="memory_budget must be at least 64 MiB"):
        run(tmp_path, "x", str(days[0]), memory_budget=1000)
    with pytest.raises(UserError, match="does not apply with hash_buckets"):
        run(tmp_path, "x", str(days[0]), memory_budget=1 << 30, hash_buckets=10)


# --------------------------------------------------------------------------- item 3: worker processes


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {"hash_buckets": 1000, "split_by": "terabyte"},
    {"min_count": 2},
    {"min_count": 2, "spill": False, "on_error": "skip"},
])
def test_workers_write_the_one_process_bytes(tmp_path, days, options):
    inputs = [str(p) for p in days]
    if options.get("on_error") == "skip":  # a bad line to drop, in both passes
        bad = tmp_path / "day_1"
        lines = days[1].read_bytes().split(b"\n")
        lines[10] = b"not\ta\tcriteo\tline"
        bad.write_bytes(b"\n".join(lines))
        inputs[1] = str(bad)
    one = run(tmp_path, "one", inputs, workers=1, block_size=16384, row_group_rows=256, shard_rows=512, **options)
    two = run(tmp_path, "two", inputs, workers=2, block_size=16384, row_group_rows=256, shard_rows=512, **options)
    assert sum(len(h) for h in shard_hashes(one).values()) > 3
    assert shard_hashes(one) == shard_hashes(two)
    assert (one / "manifest.json").read_text().replace("/one", "/two") == (two / "manifest.json").read_text()


@pytest.mark.slow
def test_a_bad_line_in_a_worker_is_one_line_naming_it(tmp_path, days):
    bad = tmp_path / "day_1"
    lines = days[1].read_bytes().split(b"\n")
    lines[41] = lines[41].replace(b"\t", b"\tx", 1)
    bad.write_bytes(b"\n".join(lines))
    with pytest.raises(UserError, match=rf"{bad} line 42 column I1: 'x.*' is not an integer"):
        run(tmp_path, "x", [str(days[0]), str(bad)], workers=2, hash_buckets=10, block_size=16384)
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_blocks_too_large_for_a_slot_travel_pickled_with_the_same_bytes(tmp_path, days, monkeypatch):
    from data_tools import block_slots, criteo_workers

    inputs = [str(p) for p in days]
    options = dict(hash_buckets=1000, split_by="terabyte", block_size=16384, row_group_rows=256, shard_rows=512)
    one = run(tmp_path, "one", inputs, workers=1, **options)
    # no slack: a block longer than block_size (the carried-over line) finds no slot big enough
    monkeypatch.setattr(criteo_workers, "SLACK_BYTES", 0)
    placed = []
    real_put = block_slots.BlockSlots.put

    def put(self, data):
        slot = real_put(self, data)
        placed.append(slot is not None)
        return slot

    monkeypatch.setattr(block_slots.BlockSlots, "put", put)
    two = run(tmp_path, "two", inputs, workers=2, **options)
    assert any(placed) and not all(placed)  # both ways were taken
    assert shard_hashes(one) == shard_hashes(two)
