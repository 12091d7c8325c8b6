"""`recsys preprocess criteo`: real-format fixtures, checked against a slow
pure-Python reference (str.split + collections.Counter)."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_tools import shards
from data_tools.criteo import CriteoConfig, preprocess
from data_tools.manifest import CRITEO_SPARSE, FORMAT_VERSION, load_manifest, sha256_file
from recsys_cli.errors import UserError
from commands import RECSYS, completed_in_process

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- fixtures


def make_rows(n: int, seed: int = 0, start: int = 0) -> list[list[str]]:
    """Criteo-like rows as lists of 40 strings. I1 holds the row's global index
    (so tests can identify rows); other fields have empties and negatives; C*
    values are drawn from skewed pools (some tiny, some large)."""
    rng = random.Random(seed)
    pools = []
    for f in range(26):
        size = [2, 5, 40, 300][f % 4]
        pools.append([f"{rng.getrandbits(32):08x}" for _ in range(size)])
    weights = [[1.0 / (i + 1) for i in range(len(p))] for p in pools]
    rows = []
    for i in range(start, start + n):
        r = [str(rng.randint(0, 1)), str(i)]
        for _ in range(12):
            r.append("" if rng.random() < 0.2 else str(rng.randint(-3, 5000)))
        for f in range(26):
            r.append("" if rng.random() < 0.1 else rng.choices(pools[f], weights[f])[0])
        rows.append(r)
    return rows


def write_raw(path: Path, rows, crlf: bool = False, gz: bool = False) -> Path:
    eol = "\r\n" if crlf else "\n"
    text = "".join("\t".join(r) + eol for r in rows).encode()
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(text)
    else:
        path.write_bytes(text)
    return path


def reference(rows, min_count: int = 1):
    """Vocab sizes and expected ids per row, computed the slow obvious way."""
    counters = [Counter() for _ in range(26)]
    for r in rows:
        for f, v in enumerate(r[14:]):
            if v:
                counters[f][v] += 1
    maps = []
    for c in counters:
        frequent = sorted((v for v, k in c.items() if k >= min_count), key=lambda v: (-c[v], int(v, 16)))
        maps.append({v: i + 1 for i, v in enumerate(frequent)})
    ids = np.array([[maps[f].get(v, 0) for f, v in enumerate(r[14:])] for r in rows], dtype=np.int32)
    labels = np.array([float(r[0]) for r in rows], dtype=np.float32)
    dense = np.array(
        [[np.float32(np.log1p(np.float64(max(int(x), 0)))) if x else 0.0 for x in r[1:14]] for r in rows],
        dtype=np.float32,
    )  # log1p in float64, rounded once to float32
    return [len(m) + 1 for m in maps], ids, labels, dense


def read_split(out: Path, split: str) -> pa.Table | None:
    m = load_manifest(out)
    parts = [pq.read_table(out / s.file) for s in m.splits[split].shards]
    return pa.concat_tables(parts) if parts else None


def read_all(out: Path) -> dict[str, np.ndarray]:
    """All rows of all splits, sorted by the row index held in I1."""
    tables = [t for s in ("train", "val", "test") if (t := read_split(out, s)) is not None]
    t = pa.concat_tables(tables)
    dense = np.stack(t["dense"].to_numpy(zero_copy_only=False))
    index = np.rint(np.expm1(dense[:, 0].astype(np.float64))).astype(np.int64)
    order = np.argsort(index)
    return {
        "index": index[order],
        "label": t["label"].to_numpy()[order],
        "dense": dense[order],
        "ids": np.stack([t[c].to_numpy() for c in CRITEO_SPARSE], axis=1)[order],
    }


def split_index(out: Path, split: str) -> np.ndarray:
    t = read_split(out, split)
    if t is None:
        return np.zeros(0, np.int64)
    dense = np.stack(t["dense"].to_numpy(zero_copy_only=False))
    return np.rint(np.expm1(dense[:, 0].astype(np.float64))).astype(np.int64)


def run(tmp_path: Path, inp, out_name: str = "out", **kw):
    cfg = CriteoConfig(input=inp if isinstance(inp, list) else str(inp), output=str(tmp_path / out_name),
                       progress=False, **kw)
    return preprocess(cfg), tmp_path / out_name


@pytest.fixture(scope="module")
def rows():
    return make_rows(1500, seed=1)


# --------------------------------------------------------------------------- ids, vocabulary, values


@pytest.mark.parametrize("min_count,spill", [(1, True), (4, True), (1, False), (4, False)])
def test_ids_and_vocab_match_reference(tmp_path, rows, min_count, spill):
    raw = write_raw(tmp_path / "train.txt", rows)
    m, out = run(tmp_path, raw, min_count=min_count, split_by="ratios", block_size=4096, spill=spill)
    assert sorted(p.name for p in out.iterdir()) == [".recsys-files.json", "manifest.json", "test", "train", "val", "vocab"]
    vocab, ids, labels, dense = reference(rows, min_count)
    assert [f.vocab_size for f in m.sparse_features] == vocab
    assert [f.name for f in m.sparse_features] == CRITEO_SPARSE
    got = read_all(out)
    assert (got["index"] == np.arange(len(rows))).all()
    np.testing.assert_array_equal(got["ids"], ids)
    np.testing.assert_array_equal(got["label"], labels)
    np.testing.assert_allclose(got["dense"], dense, rtol=1e-6)
    assert (got["ids"] < np.array(vocab)).all()
    if min_count > 1:
        assert min(vocab) < max(len(set(r[14 + f] for r in rows)) for f in range(26))


def test_schema_and_row_groups(tmp_path, rows):
    raw = write_raw(tmp_path / "train.txt", rows)
    m, out = run(tmp_path, raw, split_by="ratios", split_ratios=[1, 0, 0], row_group_rows=100, shard_rows=450)
    files = [out / s.file for s in m.splits["train"].shards]
    # 450 rounds down to whole row groups: 400 rows per file
    assert [s.rows for s in m.splits["train"].shards] == [400, 400, 400, 300]
    md = pq.ParquetFile(files[0]).metadata
    assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == [100] * 4
    schema = pq.read_schema(files[0])
    assert schema.field("label").type == pa.float32()
    assert schema.field("dense").type == pa.list_(pa.float32(), 13)
    assert all(schema.field(c).type == pa.int32() for c in CRITEO_SPARSE)
    assert "session" not in schema.names
    assert m.splits["val"].rows == 0 and m.splits["val"].shards == []


def test_label_int8(tmp_path, rows):
    raw = write_raw(tmp_path / "train.txt", rows[:200])
    m, out = run(tmp_path, raw, label_dtype="int8")
    t = read_split(out, "train")
    assert t.schema.field("label").type == pa.int8()
    assert set(t["label"].to_pylist()) <= {0, 1}


def test_gzip_crlf_and_file_lists(tmp_path, rows):
    plain = write_raw(tmp_path / "a.txt", rows)
    _, out_a = run(tmp_path, plain, "a", split_by="ratios")
    gz = write_raw(tmp_path / "b.txt.gz", rows, crlf=True, gz=True)
    _, out_b = run(tmp_path, gz, "b", split_by="ratios", block_size=2048)
    # the same rows over three files (one gz + CRLF), given as a glob
    d = tmp_path / "days"
    d.mkdir()
    write_raw(d / "day_0", rows[:500])
    write_raw(d / "day_1.gz", rows[500:1000], gz=True, crlf=True)
    write_raw(d / "day_2", rows[1000:])
    m, out_c = run(tmp_path, str(d / "day_*"), "c", split_by="ratios", block_size=3000)
    a, b, c = read_all(out_a), read_all(out_b), read_all(out_c)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        np.testing.assert_array_equal(a[k], c[k])
    assert [Path(i["path"]).name for i in m.inputs] == ["day_0", "day_1.gz", "day_2"]


def test_gzip_members_and_truncation(tmp_path, rows):
    a = write_raw(tmp_path / "a.gz", rows[:700], gz=True).read_bytes()
    b = write_raw(tmp_path / "b.gz", rows[700:], gz=True).read_bytes()
    (tmp_path / "cat.gz").write_bytes(a + b)  # `cat a.gz b.gz`: two gzip members
    m, out = run(tmp_path, tmp_path / "cat.gz", split_by="ratios", split_ratios=[1, 0, 0], block_size=4096)
    assert (split_index(out, "train") == np.arange(len(rows))).all()
    (tmp_path / "cut.gz").write_bytes((a + b)[:-200])
    with pytest.raises(UserError, match="cut.gz: truncated gzip"):
        run(tmp_path, tmp_path / "cut.gz", "out2")
    assert not (tmp_path / "out2").exists()


def test_glob_natural_order(tmp_path):
    d = tmp_path / "days"
    d.mkdir()
    for k in range(12):  # day_10 and day_11 must come after day_2
        write_raw(d / f"day_{k}", make_rows(10, seed=k, start=10 * k))
    m, out = run(tmp_path, str(d / "day_*"), split_by="ratios", split_ratios=[1, 0, 0])
    assert [Path(i["path"]).name for i in m.inputs] == [f"day_{k}" for k in range(12)]
    assert (split_index(out, "train") == np.arange(120)).all()


# --------------------------------------------------------------------------- splits


@pytest.mark.parametrize("n", [700, 1003, 1506])
def test_kaggle_split_is_dlrms(tmp_path, n):
    raw = write_raw(tmp_path / "train.txt", make_rows(n, seed=n))
    m, out = run(tmp_path, raw, split_by="kaggle", block_size=4096)
    # DLRM: 7 days in file order (np.array_split), train = 6 days, last day:
    # test_indices, val_indices = np.array_split(last_day, 2)
    days = np.array_split(np.arange(n), 7)
    test, val = np.array_split(days[-1], 2)
    train = np.concatenate(days[:-1])
    assert {k: v.rows for k, v in m.splits.items()} == {"train": len(train), "val": len(val), "test": len(test)}
    np.testing.assert_array_equal(split_index(out, "train"), train)
    np.testing.assert_array_equal(split_index(out, "val"), val)
    np.testing.assert_array_equal(split_index(out, "test"), test)


def test_ratio_split(tmp_path, rows):
    raw = write_raw(tmp_path / "train.txt", rows)
    m, out = run(tmp_path, raw, split_by="ratios", split_ratios=[0.7, 0.2, 0.1])
    assert {k: v.rows for k, v in m.splits.items()} == {"train": 1050, "val": 300, "test": 150}
    np.testing.assert_array_equal(split_index(out, "val"), np.arange(1050, 1350))
    np.testing.assert_array_equal(split_index(out, "test"), np.arange(1350, 1500))


@pytest.mark.parametrize("mode", [dict(spill=True), dict(spill=False), dict(hash_buckets=97)])
def test_split_none_is_one_split_all_in_input_order(tmp_path, rows, mode):
    """split=none (documented: one split, 'all'): vocabulary mode raised KeyError 'all'."""
    raw = write_raw(tmp_path / "train.txt", rows)
    m, out = run(tmp_path, raw, split_by="none", row_group_rows=64, shard_rows=128, block_size=4096, **mode)
    assert {k: v.rows for k, v in m.splits.items()} == {"all": len(rows)}
    np.testing.assert_array_equal(split_index(out, "all"), np.arange(len(rows)))
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and p.name in ("all", "train", "val", "test")) == ["all"]
    for s in m.splits["all"].shards:
        assert sha256_file(out / s.file) == s.sha256


# --------------------------------------------------------------------------- hashing mode


def test_hash_mode(tmp_path, rows):
    raw = write_raw(tmp_path / "train.txt", rows)
    # tiny files and row groups so staged shards straddle the split boundaries
    m, out = run(tmp_path, raw, hash_buckets=97, row_group_rows=64, shard_rows=128, block_size=4096)
    assert [f.vocab_size for f in m.sparse_features] == [97] * 26
    assert m.options["mode"] == "hash"
    got = read_all(out)
    assert (got["index"] == np.arange(len(rows))).all()
    expected = np.array([[1 + int(v, 16) % 96 if v else 0 for v in r[14:]] for r in rows])
    np.testing.assert_array_equal(got["ids"], expected)
    days = np.array_split(np.arange(len(rows)), 7)
    test, val = np.array_split(days[-1], 2)
    np.testing.assert_array_equal(split_index(out, "test"), test)
    np.testing.assert_array_equal(split_index(out, "val"), val)
    for split in m.splits.values():
        for s in split.shards:
            assert sha256_file(out / s.file) == s.sha256
            assert pq.ParquetFile(out / s.file).metadata.num_rows == s.rows
    assert not (out / "_staging").exists()


# --------------------------------------------------------------------------- manifest, idempotence


def test_manifest_contents_and_idempotent_rerun(tmp_path, rows):
    raw = write_raw(tmp_path / "train.txt", rows)
    m1, out = run(tmp_path, raw, min_count=2)
    first = (out / "manifest.json").read_text()
    d = json.loads(first)
    assert d["format_version"] == FORMAT_VERSION
    assert d["source"] == "criteo"
    assert d["skipped_lines"] == 0
    assert d["inputs"] == [{"path": str(raw), "bytes": raw.stat().st_size}]
    assert d["options"]["min_count"] == 2 and d["options"]["split_by"] == "kaggle"
    assert sum(s["rows"] for s in d["splits"].values()) == len(rows)
    for split in m1.splits.values():
        for s in split.shards:
            assert sha256_file(out / s.file) == s.sha256
    m2, out2 = run(tmp_path, raw, min_count=2)  # same output: replaced
    assert out2 == out
    assert (out / "manifest.json").read_text() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "train.txt"]


# --------------------------------------------------------------------------- bad input


def _bad_rows():
    rows = make_rows(400, seed=7)
    bad = {
        57: ("C7", lambda r: r.__setitem__(14 + 6, "zz12")),
        120: ("I5", lambda r: r.__setitem__(5, "1.5")),
        200: ("C26", lambda r: r.__setitem__(39, "abcdef123")),
        260: (None, lambda r: r.pop()),  # 39 fields
        300: ("label", lambda r: r.__setitem__(0, "x")),
        333: ("I2", lambda r: r.__setitem__(2, "12ab")),
        # passes the line regex, fails Arrow's int64 conversion (found by bisection)
        350: ("I3", lambda r: r.__setitem__(3, "99999999999999999999")),
    }
    for i, (_, f) in bad.items():
        f(rows[i])
    return rows, bad


def test_on_error_raise_names_file_line_column(tmp_path):
    rows, bad = _bad_rows()
    first = min(bad)
    good = make_rows(300, seed=3)
    d = tmp_path / "in"
    d.mkdir()
    write_raw(d / "day_0.gz", good, gz=True)
    write_raw(d / "day_1.gz", rows, gz=True, crlf=True)
    with pytest.raises(UserError) as e:
        run(tmp_path, [str(d / "day_0.gz"), str(d / "day_1.gz")], block_size=2048)
    msg = str(e.value)
    assert f"day_1.gz line {first + 1} column C7" in msg
    assert "'zz12' is not 8 hex digits" in msg
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in"]


@pytest.mark.parametrize("line,column,needle", [
    (120, "I5", "'1.5' is not an integer"),
    (200, "C26", "'abcdef123' is not 8 hex digits"),
    (260, None, "expected 40 tab-separated fields, found 39"),
    (300, "label", "'x' is not a number"),
    (350, "I3", "'99999999999999999999' is not an integer"),
])
def test_on_error_raise_each_kind(tmp_path, line, column, needle):
    rows = make_rows(400, seed=7)
    rows[line] = _bad_rows()[0][line]
    raw = write_raw(tmp_path / "t.txt", rows)
    with pytest.raises(UserError) as e:
        run(tmp_path, raw, block_size=4096)
    msg = str(e.value)
    where = f"t.txt line {line + 1}" + (f" column {column}" if column else "")
    assert where in msg and needle in msg, msg


@pytest.mark.parametrize("spill", [True, False])
def test_on_error_skip_counts_and_drops(tmp_path, spill):
    rows, bad = _bad_rows()
    raw = write_raw(tmp_path / "t.txt", rows, crlf=True)
    m, out = run(tmp_path, raw, on_error="skip", split_by="ratios", block_size=2048, spill=spill)
    assert m.skipped_lines == len(bad)
    assert json.loads((out / "manifest.json").read_text())["skipped_lines"] == len(bad)
    kept = [r for i, r in enumerate(rows) if i not in bad]
    vocab, ids, labels, dense = reference(kept)
    got = read_all(out)
    assert [f.vocab_size for f in m.sparse_features] == vocab
    np.testing.assert_array_equal(got["index"], [int(r[1]) for r in kept])
    np.testing.assert_array_equal(got["ids"], ids)
    np.testing.assert_array_equal(got["label"], labels)
    assert sum(s.rows for s in m.splits.values()) == len(kept)


def test_skip_in_hash_mode(tmp_path):
    rows, bad = _bad_rows()
    raw = write_raw(tmp_path / "t.txt", rows)
    m, out = run(tmp_path, raw, on_error="skip", hash_buckets=1000, block_size=2048)
    assert m.skipped_lines == len(bad)
    assert sum(s.rows for s in m.splits.values()) == len(rows) - len(bad)


def test_empty_lines_are_bad_lines_named_or_skipped_and_counted(tmp_path):
    """An empty line (LF or CRLF) is a malformed line like any other: it was
    dropped silently, neither an error nor in skipped_lines (3,000 lines with
    6 bad and one empty gave 2,993 rows, "6 bad lines skipped"). It counts for
    the line numbers after it; a final line end (or none) is not an empty line."""
    rows = make_rows(50, seed=2)
    head, tail = "\n".join("\t".join(r) for r in rows[:10]), "\n".join("\t".join(r) for r in rows[10:])
    (tmp_path / "t.txt").write_text(head + "\n\n\r\n" + tail)  # no final newline either
    with pytest.raises(UserError, match=r"t.txt line 11: an empty line \(expected 40 tab-separated fields\) "
                                        r"\(on_error=skip drops such lines\)$"):
        run(tmp_path, tmp_path / "t.txt", split_by="ratios", split_ratios=[1, 0, 0])
    m, _ = run(tmp_path, tmp_path / "t.txt", "skipped", on_error="skip", split_by="ratios", split_ratios=[1, 0, 0])
    assert (m.splits["train"].rows, m.skipped_lines) == (50, 2)
    rows[20][14 + 2] = "xyz"
    (tmp_path / "u.txt").write_text(head + "\n" + "\n".join("\t".join(r) for r in rows[10:]) + "\n")
    with pytest.raises(UserError, match="u.txt line 21 column C3"):  # a final newline: no empty line
        run(tmp_path, tmp_path / "u.txt", "out2")
    (tmp_path / "v.txt").write_text(head + "\n\n\n" + "\n".join("\t".join(r) for r in rows[10:]) + "\r\n")
    m, _ = run(tmp_path, tmp_path / "v.txt", "out3", on_error="skip", split_by="ratios", split_ratios=[1, 0, 0])
    assert (m.splits["train"].rows, m.skipped_lines) == (49, 3)


@pytest.mark.parametrize("case", ["missing", "empty", "directory", "glob"])
def test_bad_input_paths(tmp_path, case):
    if case == "missing":
        inp, needle = tmp_path / "nope.txt", "does not exist"
    elif case == "empty":
        inp, needle = tmp_path / "empty.txt", "is empty"
        inp.write_bytes(b"")
    elif case == "directory":
        inp, needle = tmp_path, "is a directory"
    else:
        inp, needle = tmp_path / "day_*.gz", "no file matches"
    with pytest.raises(UserError, match=needle):
        run(tmp_path, inp)
    assert not (tmp_path / "out").exists()


def test_unwritable_or_occupied_output(tmp_path, rows):
    raw = write_raw(tmp_path / "t.txt", rows[:100])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError):  # parent is a file: works even as root
        preprocess(CriteoConfig(input=str(raw), output=str(blocker / "out"), progress=False))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="refusing to overwrite"):
        preprocess(CriteoConfig(input=str(raw), output=str(occupied), progress=False))
    assert (occupied / "keep.txt").read_text() == "mine"


# --------------------------------------------------------------------------- atomicity


def test_failure_in_pass_two_leaves_nothing(tmp_path, rows, monkeypatch):
    raw = write_raw(tmp_path / "t.txt", rows)
    calls = {"n": 0}
    orig = shards.ShardWriter._write_group

    def failing(self, group):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (simulated)")
        orig(self, group)

    monkeypatch.setattr(shards.ShardWriter, "_write_group", failing)
    with pytest.raises(UserError, match=r"cannot write the dataset .*out .*: disk full \(simulated\); .*out is as it was"):
        run(tmp_path, raw, row_group_rows=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


def test_failure_keeps_previous_dataset(tmp_path, rows, monkeypatch):
    raw = write_raw(tmp_path / "t.txt", rows)
    m, out = run(tmp_path, raw)
    before = (out / "manifest.json").read_text()
    raw2 = write_raw(tmp_path / "t2.txt", rows[:10] + [["1"] * 3])
    with pytest.raises(UserError):
        run(tmp_path, raw2)
    assert (out / "manifest.json").read_text() == before


# A preprocess that says "wrote" after each row group it writes, and slows down,
# so the test can kill it mid-pass 2; argv: input, output, then the config's extra
# options as JSON.
_KILLED_CHILD = r"""
import json, sys, time
from data_tools import shards
orig = shards.ShardWriter._write_group
def slow(self, group):
    orig(self, group)
    print("wrote", flush=True)
    time.sleep(0.2)
shards.ShardWriter._write_group = slow
from data_tools.criteo import CriteoConfig, preprocess
preprocess(CriteoConfig(input=sys.argv[1], output=sys.argv[2], row_group_rows=50, progress=False,
                        **json.loads(sys.argv[3])))
"""


def test_sigkill_mid_run_leaves_no_dataset_and_rerun_cleans_up(tmp_path, rows):
    raw = write_raw(tmp_path / "t.txt", rows)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(raw), str(out), "{}"], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "wrote"  # pass 2 is writing shards
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("out.tmp-")]
    assert leftovers and any((p / "train").is_dir() for p in leftovers)
    assert not any((p / "manifest.json").exists() for p in leftovers)
    m, _ = run(tmp_path, raw)
    assert (out / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "t.txt"]




def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigkill_mid_run_ends_the_worker_processes_too(tmp_path, rows):
    """A preprocess with workers killed with SIGKILL left its worker processes
    (about 200 MB each) and multiprocessing's resource tracker running for
    good: each worker waited for its next block forever. They now end within
    a second or two of their parent."""
    raw = write_raw(tmp_path / "t.txt", rows)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(raw), str(tmp_path / "out"),
                             json.dumps({"hash_buckets": 100, "workers": 2, "block_size": 4096})], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        assert proc.stdout.readline().strip() == "wrote"  # the workers are parsing
        children = _children(proc.pid)
        assert len(children) >= 2, children  # two workers (and the resource tracker)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)], "worker processes outlived their preprocess"
    finally:
        if proc.poll() is None:
            proc.kill()
        # on failure: not left running; the resource tracker last, so that it unlinks the shared memory
        children.sort(key=lambda c: b"resource_tracker" in Path(f"/proc/{c}/cmdline").read_bytes() if _alive(c) else 0)
        for c in children:
            for _ in range(25):
                if not _alive(c):
                    break
                if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes():
                    os.kill(c, signal.SIGKILL)
                time.sleep(0.2)
            if _alive(c):
                os.kill(c, signal.SIGKILL)


# --------------------------------------------------------------------------- CLI


def test_cli_end_to_end(tmp_path, capsys):
    env = {**os.environ, "RECSYS_CACHE": str(tmp_path / "cache")}
    raw = tmp_path / "raw.tsv.gz"
    r = subprocess.run([RECSYS, "preprocess", "synthetic", "rows=3000", "cardinality_scale=0.001", f"output={raw}",
                        "format=tsv"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "ds"
    r = subprocess.run([RECSYS, "preprocess", "criteo", f"input={raw}", f"output={out}", "min_count=2",
                        "split=ratios", "ratios=[0.5,0.25,0.25]"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    m = load_manifest(out)
    assert {k: v.rows for k, v in m.splits.items()} == {"train": 1500, "val": 750, "test": 750}
    assert m.options["min_count"] == 2
    assert "3,000 rows" in " ".join((r.stderr + r.stdout).split())
    # The refusals: their lines by main() in this process (commands.completed_in_process), the runs above real.
    r = completed_in_process(["preprocess", "criteo", f"input={raw}", f"output={tmp_path / 'x'}", "minn_count=2"],
                             capsys)
    assert r.returncode != 0
    err = " ".join(r.stderr.split())  # rich wraps long lines
    assert "unknown option 'minn_count'" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
    r = completed_in_process(["preprocess", "criteo", f"input={tmp_path / 'none.txt'}", f"output={tmp_path / 'x'}"],
                             capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode != 0 and "none.txt does not exist" in err and "Traceback" not in err


def test_config_errors_are_user_errors():
    from recsys_cli.preprocess import load_config, run_preprocess

    with pytest.raises(UserError, match="unknown option 'min_cnt'"):
        load_config("criteo", ["min_cnt=3"])
    with pytest.raises(UserError, match="min_count"):
        load_config("criteo", ["min_count=three"])
    with pytest.raises(UserError, match="unknown option 'extra'"):
        load_config("criteo", ["+extra=1"])
    with pytest.raises(UserError, match="unknown option 'rowz'"):
        load_config("synthetic", ["rowz=10"])
    syn = load_config("synthetic", ["rows=10", "sessions=true", "output=o"])
    assert syn.rows == 10 and syn.sessions is True and syn.format == "parquet"
    with pytest.raises(UserError, match="unknown preprocess source"):
        run_preprocess("avazu", [])
    cfg = load_config("criteo", ["input=[a,b]", "output=o", "hash_buckets=10"])
    assert cfg.input == ["a", "b"] and cfg.hash_buckets == 10 and isinstance(cfg, CriteoConfig)
    with pytest.raises(UserError, match="split_by must be"):
        run_preprocess("criteo", ["input=a", "output=o", "split=weekly"])


@pytest.mark.parametrize("codec", ["bogus", "lzo"])
def test_an_unknown_compression_is_refused_before_any_work(tmp_path, rows, codec):
    """compression=bogus ran pass 1, then ended in pyarrow's ArrowException
    traceback (lzo: an OSError's) at the first shard; now one line up front."""
    raw = write_raw(tmp_path / "train.txt", rows[:50])
    with pytest.raises(UserError, match=rf"compression must be a parquet codec .*got '{codec}'"):
        run(tmp_path, raw, compression=codec)
    assert not list(tmp_path.glob("out*"))
    run(tmp_path, raw, compression="zstd")  # another codec parquet has


@pytest.mark.parametrize("kind", ["xz-compressed", "bzip2-compressed", "a zip archive"])
def test_a_file_compressed_otherwise_than_gzip_is_named_as_such(tmp_path, rows, kind):
    """An .xz, .bz2 or .zip input was read as text: 'line 1: expected 40
    tab-separated fields, found 2' (with on_error=skip: every line skipped).
    Now one line saying what it is, for preprocess and predict's reader."""
    import bz2
    import lzma
    import zipfile

    from data_tools.criteo_input import labelled

    text = "".join("\t".join(r) + "\n" for r in rows[:30]).encode()
    path = tmp_path / "day_0.x"
    if kind == "xz-compressed":
        path.write_bytes(lzma.compress(text))
    elif kind == "bzip2-compressed":
        path.write_bytes(bz2.compress(text))
    else:
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("day_0", text)
    needle = rf"{path} is {kind}: recsys reads plain or gzip'd Criteo TSV"
    for on_error in ("raise", "skip"):
        with pytest.raises(UserError, match=needle):
            run(tmp_path, path, on_error=on_error)
    with pytest.raises(UserError, match=needle):
        labelled(path)


@pytest.mark.parametrize("block_size", [1024, 8 << 20])
def test_a_byte_order_mark_starts_a_file_or_is_a_bad_line(tmp_path, rows, block_size):
    """A UTF-8 byte order mark that starts a file is dropped (Windows editors
    write one). One inside the input (two files joined with cat) passed where
    it began a block and failed inside one, where no bad line was found: the
    run ended in 'input changed while it was being preprocessed'. It is now
    a bad line named by file, line and column, or skipped and counted."""
    bom = b"\xef\xbb\xbf"
    text = "".join("\t".join(r) + "\n" for r in rows[:40]).encode()
    plain = tmp_path / "plain.txt"
    plain.write_bytes(text)
    first = tmp_path / "first.txt"
    first.write_bytes(bom + text)
    m1, out1 = run(tmp_path, plain, "a", split_by="none", block_size=block_size)
    m2, out2 = run(tmp_path, first, "b", split_by="none", block_size=block_size)
    assert read_split(out1, "all").equals(read_split(out2, "all"))
    joined = tmp_path / "joined.txt"
    joined.write_bytes(text + bom + text)
    with pytest.raises(UserError, match=rf"{joined} line 41 column label: '\\ufeff.' is not a number"):
        run(tmp_path, joined, "c", split_by="none", block_size=block_size)
    m, _ = run(tmp_path, joined, "d", split_by="none", block_size=block_size, on_error="skip")
    assert m.skipped_lines == 1 and m.splits["all"].rows == 79
