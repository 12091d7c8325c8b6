"""The synthetic Criteo-like generator: determinism, schema, vocabularies,
sessions, multi-hot bags, the hidden label model, TSV round trip, cache."""

from __future__ import annotations

import gzip
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_tools.criteo import CriteoConfig, preprocess
from data_tools.manifest import CRITEO_SPARSE, load_manifest
from data_tools.metrics import roc_auc
from data_tools.synthetic import (
    KAGGLE_CARDINALITIES,
    SyntheticConfig,
    default_dataset,
    generate,
    hex_values,
    vocab_sizes,
    write_tsv,
)
from recsys_cli.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def read(out: Path, splits=("train", "val", "test")) -> pa.Table:
    m = load_manifest(out)
    return pa.concat_tables([pq.read_table(out / s.file) for sp in splits for s in m.splits[sp].shards])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn") / "ds"
    cfg = SyntheticConfig(cardinality_scale=0.001, rows=30_000, row_group_rows=4096)
    return cfg, generate(cfg, out), out


def test_deterministic_from_seed(tmp_path, small):
    cfg, m, out = small
    m2 = generate(cfg, tmp_path / "again")
    assert m2.to_json() == m.to_json()  # includes every shard's sha256
    m3 = generate(SyntheticConfig(cardinality_scale=0.001, rows=30_000, row_group_rows=4096, seed=1),
                  tmp_path / "other")
    assert [s.sha256 for s in m3.splits["train"].shards] != [s.sha256 for s in m.splits["train"].shards]


def test_schema_vocab_and_splits(small):
    cfg, m, out = small
    t = read(out)
    assert t.schema.field("label").type == pa.float32()
    assert t.schema.field("dense").type == pa.list_(pa.float32(), 13)
    assert [f.name for f in m.sparse_features] == CRITEO_SPARSE
    assert all(t.schema.field(c).type == pa.int32() for c in CRITEO_SPARSE)
    assert "session" not in t.schema.names and m.session_column is None
    assert {k: v.rows for k, v in m.splits.items()} == {"train": 24_000, "val": 3_000, "test": 3_000}
    expected = [min(c, max(3, math.ceil(c * 0.001))) for c in KAGGLE_CARDINALITIES]
    assert [f.vocab_size for f in m.sparse_features] == expected == vocab_sizes(cfg)
    for f in m.sparse_features:
        x = t[f.name].to_numpy()
        assert x.min() >= 0 and x.max() < f.vocab_size
    assert set(np.unique(t["label"].to_numpy())) <= {0.0, 1.0}
    dense = np.stack(t["dense"].to_numpy(zero_copy_only=False))
    assert dense.shape == (30_000, 13) and dense.min() >= 0 and np.isfinite(dense).all()
    # Criteo-like missingness: C22 often missing (id 0), C1 never
    assert (t["C22"].to_numpy() == 0).mean() > 0.15 and (t["C1"].to_numpy() == 0).mean() == 0
    md = pq.ParquetFile(out / m.splits["train"].shards[0].file).metadata
    assert md.row_group(0).num_rows == 4096


def test_zipf_ids_skewed_and_scattered(small):
    _, m, out = small
    x = read(out)["C3"].to_numpy()  # vocab 10132
    counts = np.bincount(x[x > 0])
    top = np.argsort(counts)[::-1][:10]
    assert counts[top].sum() / (x > 0).sum() > 0.15  # heavy head
    assert top.max() > 100  # hot ids are not 1..10


def test_hidden_model_click_rate_and_auc(small):
    _, m, out = small
    hidden = m.options["hidden_model"]
    assert 0.22 < hidden["click_rate"] < 0.28
    assert 0.76 < hidden["val_auc"] < 0.88
    # learnable: per-id click rates estimated on train rank val rows well
    tr, va = read(out, ["train"]), read(out, ["val"])
    y, yv = tr["label"].to_numpy(), va["label"].to_numpy()
    p0 = y.mean()
    score = np.zeros(len(yv))
    for f in m.sparse_features:
        c = np.bincount(tr[f.name].to_numpy(), minlength=f.vocab_size)
        s = np.bincount(tr[f.name].to_numpy(), weights=y, minlength=f.vocab_size)
        p = (s + 20 * p0) / (c + 20)
        score += np.log(p / (1 - p))[va[f.name].to_numpy()]
    assert roc_auc(score, yv) > 0.68


@pytest.mark.parametrize("repeat", [0.85, 0.3])
def test_sessions_repeat_values_and_stay_whole(tmp_path, repeat):
    cfg = SyntheticConfig(rows=20_000, sessions=True, session_repeat=repeat, cardinality_scale=0.01,
                          multi_hot_features=2, multi_hot_min_length=2, multi_hot_max_length=7,
                          row_group_rows=1000)
    m = generate(cfg, tmp_path / "s")
    assert m.session_column == "session"
    # row groups end at session boundaries (a loader shuffling row groups keeps sessions whole)
    for split in m.splits.values():
        last = None
        for shard in split.shards:
            f = pq.ParquetFile(tmp_path / "s" / shard.file)
            for g in range(f.metadata.num_row_groups):
                sg = f.read_row_group(g, columns=["session"])["session"].to_numpy()
                assert 900 <= len(sg) <= 1000 or g == f.metadata.num_row_groups - 1
                assert sg[0] != last
                last = sg[-1]
    t = read(tmp_path / "s")
    sess = t["session"].to_numpy()
    assert t.schema.field("session").type == pa.int64()
    assert (np.diff(sess) >= 0).all()  # sessions are contiguous, in order
    lens = np.bincount(sess)
    assert 7.0 < lens.mean() < 9.0
    # each session in exactly one split
    per_split = [set(read(tmp_path / "s", [s])["session"].to_pylist()) for s in ("train", "val", "test")]
    assert not (per_split[0] & per_split[1]) and not (per_split[1] & per_split[2])
    assert abs(m.splits["train"].rows - 16_000) < 100
    # fraction of a session's samples equal to its most common value ~ repeat
    for name in ("C3", "C12"):
        x = t[name].to_numpy()
        order = np.lexsort((x, sess))
        xs, ss = x[order], sess[order]
        change = np.concatenate([[True], (ss[1:] != ss[:-1]) | (xs[1:] != xs[:-1])])
        runs = np.diff(np.concatenate([np.flatnonzero(change), [len(xs)]]))
        mode = np.zeros(len(lens), dtype=np.int64)
        np.maximum.at(mode, ss[change], runs)
        long = lens >= 8
        frac = mode[long].sum() / lens[long].sum()
        assert abs(frac - repeat) < 0.06, (name, frac)
    # multi-hot: list<int32>, lengths in bounds, one bag per session
    for h in ("H1", "H2"):
        assert t.schema.field(h).type == pa.list_(pa.int32())
        f = m.feature(h)
        assert f.multi_hot and f.vocab_size == cfg.multi_hot_vocab
        col = t[h].combine_chunks()
        lengths = np.diff(col.offsets.to_numpy())
        assert lengths.min() >= 2 and lengths.max() <= 7
        vals = col.values.to_numpy()
        assert vals.min() >= 1 and vals.max() < cfg.multi_hot_vocab
        bags = col.to_pylist()
        first = {}
        for s, b in zip(sess.tolist(), bags):
            assert first.setdefault(s, b) == b


def test_multi_hot_without_sessions(tmp_path):
    cfg = SyntheticConfig(cardinality_scale=0.001, rows=3000, multi_hot_features=1, multi_hot_min_length=0,
                          multi_hot_max_length=3,
                          multi_hot_vocab=50)
    generate(cfg, tmp_path / "m")
    col = read(tmp_path / "m")["H1"].combine_chunks()
    lengths = np.diff(col.offsets.to_numpy())
    assert set(np.unique(lengths)) == {0, 1, 2, 3}
    assert col.values.to_numpy().max() < 50


def test_tsv_round_trips_through_criteo_preprocess(tmp_path):
    cfg = SyntheticConfig(cardinality_scale=0.001, rows=12_000, missing_rate=0.1)
    syn = generate(cfg, tmp_path / "syn")
    raw = write_tsv(cfg, tmp_path / "raw.txt.gz")
    lines = gzip.open(raw, "rt").read().splitlines()
    assert len(lines) == 12_000 and all(len(ln.split("\t")) == 40 for ln in lines[:100])
    assert any(f.startswith("-") for ln in lines[:2000] for f in ln.split("\t")[1:14])
    fields = [ln.split("\t") for ln in lines[:3000]]
    empty = np.array([[f == "" for f in r] for r in fields]).mean(axis=0)
    assert empty[2] == 0 and empty[12] > 0.3  # I2 never missing, I12 mostly (Criteo-like)
    assert empty[14] == 0 and empty[14 + 21] > 0.3  # C1 never, C22 mostly
    m = preprocess(CriteoConfig(input=str(raw), output=str(tmp_path / "pre"), split_by="ratios",
                                split_ratios=cfg.split_ratios, progress=False))
    assert {k: v.rows for k, v in m.splits.items()} == {k: v.rows for k, v in syn.splits.items()}
    a, b = read(tmp_path / "syn"), read(tmp_path / "pre")
    np.testing.assert_array_equal(a["label"].to_numpy(), b["label"].to_numpy())
    np.testing.assert_array_equal(np.stack(a["dense"].to_numpy(zero_copy_only=False)),
                                  np.stack(b["dense"].to_numpy(zero_copy_only=False)))
    for f, name in enumerate(CRITEO_SPARSE):
        x, y = a[name].to_numpy(), b[name].to_numpy()
        assert ((x == 0) == (y == 0)).all()
        pairs = np.unique(np.stack([x, y]), axis=1)
        # a bijection between generator ids and preprocessed ids
        assert pairs.shape[1] == len(np.unique(x)) == len(np.unique(y))
        assert m.feature(name).vocab_size <= syn.feature(name).vocab_size
    # the hex written for id k of feature f is hex_values(f, k)
    first = lines[0].split("\t")
    ids0 = {name: int(a[name][0].as_py()) for name in CRITEO_SPARSE}
    for f, name in enumerate(CRITEO_SPARSE):
        if ids0[name]:
            assert first[14 + f] == f"{int(hex_values(f, np.array([ids0[name]]), cfg.seed)[0]):08x}"


def test_tsv_plain_equals_gz(tmp_path):
    cfg = SyntheticConfig(cardinality_scale=0.001, rows=2000)
    write_tsv(cfg, tmp_path / "a.txt")
    write_tsv(cfg, tmp_path / "b.txt.gz")
    assert (tmp_path / "a.txt").read_bytes() == gzip.open(tmp_path / "b.txt.gz").read()
    with pytest.raises(UserError, match="multi-hot"):
        write_tsv(SyntheticConfig(cardinality_scale=0.001, rows=10, multi_hot_features=1), tmp_path / "c.txt")


def test_bad_config_is_user_error(tmp_path):
    with pytest.raises(UserError, match="session_repeat"):
        generate(SyntheticConfig(cardinality_scale=0.001, rows=10, session_repeat=1.5), tmp_path / "x")
    with pytest.raises(UserError, match="split_ratios must be three"):
        generate(SyntheticConfig(cardinality_scale=0.001, rows=10, split_ratios=[0.5, 0.5]), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_default_dataset_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("RECSYS_CACHE", str(tmp_path / "cache"))
    cfg = SyntheticConfig(cardinality_scale=0.001, rows=2000)
    p = default_dataset(cfg)
    assert p.parent == tmp_path / "cache" and p.name.startswith("synthetic-")
    mtime = (p / "manifest.json").stat().st_mtime_ns
    assert default_dataset(SyntheticConfig(cardinality_scale=0.001, rows=2000)) == p
    assert (p / "manifest.json").stat().st_mtime_ns == mtime  # reused, not regenerated
    q = default_dataset(SyntheticConfig(cardinality_scale=0.001, rows=2000, seed=5), cache_dir=tmp_path / "other")
    assert q.parent == tmp_path / "other" and q.name != p.name


_RACER = r"""
import sys
from pathlib import Path
from data_tools.synthetic import SyntheticConfig, default_dataset
print(default_dataset(SyntheticConfig(cardinality_scale=0.001, rows=20000), Path(sys.argv[1])))
"""


def test_default_dataset_concurrent_callers(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    load_manifest(outs[0])
    entries = sorted(e.name for e in tmp_path.iterdir() if not e.name.startswith("."))
    assert entries == [Path(outs[0]).name]


def test_a_scale_above_one_grows_the_tables_past_kaggle(tmp_path):
    """Disk-tier benchmarks need tables larger than memory: x12 multiplies
    every vocabulary (no cap at Kaggle's; generating it is bench-sized, not
    test-sized, so only the sizes are checked), and a scale whose ids would
    overflow the generator's int32 is refused."""
    cfg = SyntheticConfig(rows=2_000, cardinality_scale=12.0)
    assert vocab_sizes(cfg) == [math.ceil(12 * c) for c in KAGGLE_CARDINALITIES]
    assert sum(vocab_sizes(cfg)) > 400_000_000
    with pytest.raises(UserError, match="2\\*\\*31"):
        generate(SyntheticConfig(rows=100, cardinality_scale=1000.0), tmp_path / "huge")
    assert not (tmp_path / "huge").exists()


def test_cardinalities_give_each_table_its_rows(tmp_path):
    """dataset.synthetic.cardinalities replaces the Kaggle profile the scale
    applies to: at scale 1.0 the tables have exactly those rows (MLPerf
    DLRM-DCNv2's, dataset=synthetic_mlperf; checked here at 1/20 000, as
    the generated manifest says them); a list of the wrong length is
    refused; an unset list keeps every earlier dataset's cache key."""
    import dataclasses

    import yaml

    from data_tools.synthetic import MLPERF_CARDINALITIES, config_hash, profile

    assert sum(MLPERF_CARDINALITIES) == 204_184_588
    shipped = yaml.safe_load((Path(__file__).parent.parent / "configs/dataset/synthetic_mlperf.yaml").read_text())
    assert shipped["synthetic"]["cardinalities"] == MLPERF_CARDINALITIES
    assert vocab_sizes(SyntheticConfig(cardinality_scale=1.0, cardinalities=MLPERF_CARDINALITIES)) == MLPERF_CARDINALITIES
    small = [max(3, c // 20_000) for c in MLPERF_CARDINALITIES]
    m = generate(SyntheticConfig(rows=3_000, cardinality_scale=1.0, cardinalities=small), tmp_path / "mlperf")
    assert [f.vocab_size for f in m.sparse_features] == small
    assert profile(SyntheticConfig()) == KAGGLE_CARDINALITIES
    with pytest.raises(UserError, match="cardinalities must be 26 integers"):
        generate(SyntheticConfig(rows=100, cardinalities=[5] * 25), tmp_path / "short")
    assert not (tmp_path / "short").exists()
    import hashlib
    import json

    from data_tools.synthetic import GENERATOR_VERSION

    default = SyntheticConfig()
    # the key as it was before either option (profile, cardinalities) existed
    before = {k: v for k, v in dataclasses.asdict(default).items() if k not in ("cardinalities", "profile")}
    payload = json.dumps({"generator": GENERATOR_VERSION, **before}, sort_keys=True, default=str)
    assert config_hash(default) == hashlib.sha256(payload.encode()).hexdigest()[:16]
    assert config_hash(SyntheticConfig(cardinalities=KAGGLE_CARDINALITIES)) != config_hash(default)
