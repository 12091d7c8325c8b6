"""The saved vocabulary and `recsys preprocess criteo vocab=DIR`, checked against
a str.split + collections.Counter reference."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data_tools.criteo import CriteoConfig, preprocess
from data_tools.manifest import CRITEO_SPARSE, load_manifest
from data_tools.vocab import load_vocabulary
from recsys_cli.errors import UserError
from test_criteo_preprocess import make_rows, write_raw


def reference_maps(rows, min_count: int = 1) -> list[dict[str, int]]:
    counters = [Counter() for _ in range(26)]
    for r in rows:
        for f, v in enumerate(r[14:]):
            if v:
                counters[f][v.lower()] += 1
    maps = []
    for c in counters:
        frequent = sorted((v for v, k in c.items() if k >= min_count), key=lambda v: (-c[v], int(v, 16)))
        maps.append({v: i + 1 for i, v in enumerate(frequent)})
    return maps


def run(tmp_path: Path, raw: Path, name: str, **kw):
    cfg = CriteoConfig(input=str(raw), output=str(tmp_path / name), progress=False, block_size=4096, **kw)
    return preprocess(cfg), tmp_path / name


def split_rows(out: Path, split: str):
    m = load_manifest(out)
    tables = [pq.read_table(out / s.file) for s in m.splits[split].shards]
    ids = np.concatenate([np.stack([t[c].to_numpy() for c in CRITEO_SPARSE], axis=1) for t in tables])
    dense = np.concatenate([np.stack(t["dense"].to_numpy(zero_copy_only=False)) for t in tables])
    index = np.rint(np.expm1(dense[:, 0].astype(np.float64))).astype(np.int64)
    return index, ids, tables[0].schema.names


@pytest.fixture(scope="module")
def train_rows():
    return make_rows(1200, seed=3)


@pytest.mark.parametrize("min_count", [1, 3])
def test_vocabulary_round_trip(tmp_path, train_rows, min_count):
    m, out = run(tmp_path, write_raw(tmp_path / "train.txt", train_rows), "train", min_count=min_count)
    entry = m.options["vocabulary"]
    assert entry["mode"] == "vocabulary" and entry["min_count"] == min_count
    assert entry["bytes"] == sum((out / e[k]["file"]).stat().st_size for e in entry["files"].values()
                                 for k in ("values", "ids"))
    vocab = load_vocabulary(out, verify=True)
    maps = reference_maps(train_rows, min_count)
    for f, ref in enumerate(maps):
        table = vocab.tables[f]
        assert table.values.dtype == np.uint32 and table.ids.dtype == np.int32
        assert (np.diff(table.values.astype(np.int64)) > 0).all()  # sorted, unique
        saved = {f"{int(v):08x}": int(i) for v, i in zip(table.values, table.ids)}
        assert saved == ref
        assert m.sparse_features[f].vocab_size == len(ref) + 1
        # lookups: every value seen in training (rare ones -> 0) and unseen ones -> 0
        seen = sorted({r[14 + f].lower() for r in train_rows if r[14 + f]})
        raw = np.array([int(v, 16) for v in seen] + [0xFFFFFFFF, 0, 0x12345678], dtype=np.uint32)
        expect = [ref.get(v, 0) for v in seen] + [ref.get(f"{x:08x}", 0) for x in (0xFFFFFFFF, 0, 0x12345678)]
        np.testing.assert_array_equal(vocab.lookup(f, raw), np.array(expect, dtype=np.int32))


def test_vocabulary_size_in_summary(tmp_path, train_rows, capsys):
    from rich.console import Console

    cfg = CriteoConfig(input=str(write_raw(tmp_path / "t.txt", train_rows)), output=str(tmp_path / "o"), progress=False)
    m = preprocess(cfg, console=Console(stderr=True, width=200))
    size = sum(e["size"] for e in m.options["vocabulary"]["files"].values())
    assert f"saved vocabulary: {size:,} values" in capsys.readouterr().err


def new_day(train_rows, n=700, seed=11):
    """Rows of a later day: most values seen in training, some new ones."""
    rows = make_rows(n, seed=seed, start=10_000)
    rng = np.random.default_rng(seed)
    for r, old in zip(rows, (train_rows[i] for i in rng.integers(0, len(train_rows), n))):
        for f in range(26):
            if rng.random() < 0.7:
                r[14 + f] = old[14 + f].upper() if rng.random() < 0.1 else old[14 + f]
    return rows


@pytest.mark.parametrize("split", ["none", "kaggle"])
def test_preprocess_with_existing_vocabulary(tmp_path, train_rows, split):
    m_train, train = run(tmp_path, write_raw(tmp_path / "train.txt", train_rows), "train", min_count=2)
    rows = new_day(train_rows)
    m, out = run(tmp_path, write_raw(tmp_path / "day.txt", rows), "day", vocab=str(train), split_by=split)
    maps = reference_maps(train_rows, min_count=2)
    expect = np.array([[maps[f].get(v.lower(), 0) for f, v in enumerate(r[14:])] for r in rows], dtype=np.int32)
    if split == "none":
        assert list(m.splits) == ["all"]
        index, ids, _ = split_rows(out, "all")
        np.testing.assert_array_equal(index, np.arange(10_000, 10_000 + len(rows)))  # input order
    else:
        parts = [split_rows(out, s) for s in ("train", "test", "val")]
        index = np.concatenate([p[0] for p in parts])
        ids = np.concatenate([p[1] for p in parts])
        np.testing.assert_array_equal(index, np.arange(10_000, 10_000 + len(rows)))
    np.testing.assert_array_equal(ids, expect)
    assert [f.vocab_size for f in m.sparse_features] == [f.vocab_size for f in m_train.sparse_features]
    unknown = {name: sum(1 for r in rows if r[14 + f] and r[14 + f].lower() not in maps[f])
               for f, name in enumerate(CRITEO_SPARSE)}
    assert m.options["unknown_values"] == unknown and sum(unknown.values()) > 0
    # the new dataset carries the same vocabulary, so it can serve as vocab= itself
    assert m.options["vocabulary"]["fingerprint"] == m_train.options["vocabulary"]["fingerprint"]
    assert load_vocabulary(out, verify=True).fingerprint == m_train.options["vocabulary"]["fingerprint"]


def test_unlabelled_input(tmp_path, train_rows):
    _, train = run(tmp_path, write_raw(tmp_path / "train.txt", train_rows), "train")
    rows = new_day(train_rows, n=300)
    _, labelled = run(tmp_path, write_raw(tmp_path / "day.txt", rows), "labelled", vocab=str(train), split_by="none")
    m, out = run(tmp_path, write_raw(tmp_path / "test.txt", [r[1:] for r in rows]), "unlabelled",
                 vocab=str(train), split_by="none", labels=False)
    assert m.labelled is False
    index, ids, names = split_rows(out, "all")
    assert "label" not in names
    ref_index, ref_ids, _ = split_rows(labelled, "all")
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_array_equal(ids, ref_ids)


@pytest.mark.parametrize("labels,drop,needle", [
    (False, False, "expected 39 tab-separated fields (labels=false), found 40 (a labelled line? drop labels=false)"),
    (True, True, "expected 40 tab-separated fields, found 39: the input looks unlabelled"),
])
def test_wrong_column_count(tmp_path, train_rows, labels, drop, needle):
    _, train = run(tmp_path, write_raw(tmp_path / "train.txt", train_rows), "train")
    rows = [r[1:] if drop else r for r in train_rows[:50]]
    raw = write_raw(tmp_path / "bad.txt", rows)
    with pytest.raises(UserError) as e:
        run(tmp_path, raw, "bad", vocab=str(train), labels=labels, split_by="none")
    assert f"{raw} line 1" in str(e.value) and needle in str(e.value)
    assert not (tmp_path / "bad").exists()


def test_vocab_option_errors(tmp_path, train_rows):
    raw = write_raw(tmp_path / "train.txt", train_rows)
    with pytest.raises(UserError, match="no saved vocabulary|not a preprocessed dataset|does not exist"):
        run(tmp_path, raw, "x", vocab=str(tmp_path / "missing"))
    with pytest.raises(UserError, match="min_count and hash_buckets do not apply"):
        run(tmp_path, raw, "x", vocab=str(tmp_path), min_count=2)
    with pytest.raises(UserError, match="labels=false needs vocab=DIR"):
        run(tmp_path, raw, "x", labels=False)


def test_recsys_verify_checks_the_saved_vocabulary(tmp_path, train_rows):
    from recsys_cli.verify import run_verify

    _, out = run(tmp_path, write_raw(tmp_path / "train.txt", train_rows), "train")
    run_verify([str(out)])  # a fresh dataset passes
    values = out / load_manifest(out).options["vocabulary"]["files"]["C3"]["values"]["file"]
    data = bytearray(values.read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])  # same size, other raw values
    values.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"{values}: vocabulary file does not match its sha256"):
        run_verify([str(out)])


def test_a_dataset_naming_files_outside_itself_is_refused(tmp_path, train_rows):
    """A dataset is untrusted: a vocabulary file named `../victim.txt` (a valid
    .npy there) made `recsys preprocess vocab=DIR` copy it over the file of
    that name beside the output, a user's file; a shard named outside the
    dataset would be read. Both are one line naming the manifest and the key."""
    import json
    import shutil

    raw = write_raw(tmp_path / "train.txt", train_rows)
    _, src = run(tmp_path, raw, "src")
    evil = tmp_path / "downloads" / "evil"
    shutil.copytree(src, evil)
    shutil.copy(evil / "vocab" / "C1.ids.npy", evil.parent / "victim.txt")  # what would be written
    (tmp_path / "victim.txt").write_text("precious")
    manifest = json.loads((evil / "manifest.json").read_text())
    manifest["options"]["vocabulary"]["files"]["C1"]["ids"]["file"] = "../victim.txt"
    (evil / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"vocabulary file \(C1 ids\) '../victim.txt' is not a file inside"):
        run(tmp_path, raw, "out", vocab=str(evil))
    assert (tmp_path / "victim.txt").read_text() == "precious"
    with pytest.raises(UserError, match=r"vocabulary file \(C1 ids\) '../victim.txt' is not a file inside"):
        load_vocabulary(evil)
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["file"] = str(tmp_path / "train.txt")
    (src / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"split train's shard '/.*train.txt' is not a file inside"):
        load_manifest(src)


@pytest.mark.parametrize("damage,needle", [
    (lambda v: v["files"].pop("C5"), r"options.vocabulary.files.C5: missing"),
    (lambda v: v.pop("features"), r"options.vocabulary.features: not a list"),
    (lambda v: v["files"]["C2"]["ids"].pop("sha256"), r"options.vocabulary.files.C2.ids: missing"),
    (lambda v: v.update(mode="bloom"), r"options.vocabulary.mode: 'bloom'"),
], ids=["no-C5", "no-features", "no-sha256", "bad-mode"])
def test_a_malformed_vocabulary_entry_is_one_line(tmp_path, train_rows, damage, needle):
    """A vocabulary entry missing a key was a KeyError's traceback in predict,
    preprocess vocab=DIR and verify; now one line naming the manifest and key."""
    import json

    from recsys_cli.verify import run_verify

    _, src = run(tmp_path, write_raw(tmp_path / "train.txt", train_rows), "src")
    manifest = json.loads((src / "manifest.json").read_text())
    damage(manifest["options"]["vocabulary"])
    (src / "manifest.json").write_text(json.dumps(manifest))
    for attempt in (lambda: load_vocabulary(src), lambda: run(tmp_path, tmp_path / "train.txt", "out", vocab=str(src)),
                    lambda: run_verify([str(src)])):
        with pytest.raises(UserError, match=rf"{src}/manifest.json: malformed vocabulary entry \({needle}"):
            attempt()
