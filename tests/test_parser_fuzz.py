"""The Criteo parser, fuzzed (issue 40 item 5).

Valid Criteo rows are mutated (bytes flipped, inserted and deleted; fields
added, removed and replaced by huge, signed, spaced, hex-prefixed, float or
unicode values; tabs, newlines, CR, CRLF, NUL inserted; blank lines; no final
newline) and every parser the tool has for raw rows is held to a reference
parser written here from the documented format alone (data_tools/criteo.py's
docstring and DESIGN.md's "Data"), sharing no code with data_tools:

* the reading preprocess does (data_tools.criteo_input.BlockReader, in blocks
  small enough that lines straddle them), on_error=raise and on_error=skip;
* `recsys preprocess` itself, in-process (preprocess() in hash mode, split_by=none,
  whose ids the reference computes), for fewer examples;
* `recsys predict`'s raw reading (decoded_blocks, 39 or 40 fields);
* `recsys_cli.export.raw_inputs` (a list of lines).

Either the input is valid and every parser gives exactly the reference's
values (labels, the integers as written, log1p'd dense, hex values and which
are missing), or it is not and the error is one line that names the first bad
line and its column (or, for a wrong field count, says so). With on_error=skip
exactly the reference's bad lines are dropped.

Examples per test: FUZZ_EXAMPLES (make test: about 1,400 cases in all,
about 13 s of CPU with the imports; 21 s of wall time on a 2-core machine
at load 6), the same ones each run; `make verify`
(RECSYS_VERIFY=1) runs VERIFY_EXAMPLES each, new ones each run;
RECSYS_FUZZ_EXAMPLES=N sets it by hand. The test at the end counts the cases
tried and prints them (pytest -s).
"""

from __future__ import annotations

import atexit
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from data_tools.criteo_input import BlockReader, decoded_blocks
from data_tools.errors import UserError

VERIFY = bool(os.environ.get("RECSYS_VERIFY"))
FUZZ_EXAMPLES = 300  # per test in make test (raw_inputs, the cheapest, 1.5x)
VERIFY_EXAMPLES = 20_000  # per test in make verify (random seeds there; fixed ones in make test)
# RECSYS_FUZZ_EXAMPLES=N: N per test (a longer or shorter run by hand)
EXAMPLES = int(os.environ.get("RECSYS_FUZZ_EXAMPLES") or (VERIFY_EXAMPLES if VERIFY else FUZZ_EXAMPLES))
settings.register_profile(
    "fuzz", max_examples=EXAMPLES, deadline=None, derandomize=not VERIFY,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], database=None,
)
FUZZ = settings.get_profile("fuzz")
CHEAP = settings(FUZZ, max_examples=int(FUZZ.max_examples * 1.5))
# A full preprocess() writes parquet, a manifest and renames a directory: tens of ms an example.
FULL = settings(FUZZ, max_examples=max(1, EXAMPLES // 9))

CASES: dict[str, int] = {}  # test -> examples tried (the report at the end)


def tried(name: str) -> None:
    CASES[name] = CASES.get(name, 0) + 1


DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]


# --------------------------------------------------------------------------- the reference parser


@dataclass
class Row:
    label: float | None
    dense: list[int]  # as written, missing -> 0
    sparse: list[int | None]  # the 32-bit value, None = missing


@dataclass
class Bad:
    line: int  # 1-based, in the file
    column: str | None  # None: the field count is wrong


DIGITS = frozenset(b"0123456789")
HEXDIGITS = frozenset(b"0123456789abcdefABCDEF")


def _strip_spaces(b: bytes) -> bytes:
    i, j = 0, len(b)
    while i < j and b[i] == 0x20:
        i += 1
    while j > i and b[j - 1] == 0x20:
        j -= 1
    return b[i:j]


def ref_label(b: bytes) -> float | None:
    """A decimal number (sign, fraction, exponent; ASCII; spaces around) whose
    float32 value is in [0, 1]; else None."""
    s = _strip_spaces(b)
    if s[:1] in (b"+", b"-"):
        s = s[1:]
    mant, _, exp = s.partition(b"e") if b"e" in s else s.partition(b"E")
    if b"e" in s or b"E" in s:
        e = exp[1:] if exp[:1] in (b"+", b"-") else exp
        if not e or not set(e) <= DIGITS:
            return None
    whole, dot, frac = mant.partition(b".")
    if not (whole or frac) or not set(whole) <= DIGITS or not set(frac) <= DIGITS:
        return None
    x = float(np.float32(float(_strip_spaces(b).decode("ascii"))))
    return x if 0.0 <= x <= 1.0 else None


def ref_int(b: bytes) -> int | None:
    """An optional minus and decimal digits (ASCII), spaces around, within int64; else None."""
    s = _strip_spaces(b)
    digits = s[1:] if s[:1] == b"-" else s
    if not digits or not set(digits) <= DIGITS:
        return None
    v = int(s)
    return v if -(2**63) <= v < 2**63 else None


def ref_hex(b: bytes) -> int | None:
    return int(b, 16) if len(b) == 8 and set(b) <= HEXDIGITS else None


def ref_line(line: bytes, labels: bool) -> Row | str | None:
    """A Row, or the first bad column's name, or None for a wrong field count."""
    fields = line.split(b"\t")
    if len(fields) != (40 if labels else 39):
        return None
    label = None
    if labels:
        label = ref_label(fields[0])
        if label is None:
            return "label"
        fields = fields[1:]
    dense = []
    for name, f in zip(DENSE, fields[:13]):
        v = 0 if f == b"" else ref_int(f)
        if v is None:
            return name
        dense.append(v)
    sparse: list[int | None] = []
    for name, f in zip(SPARSE, fields[13:]):
        h = None if f == b"" else ref_hex(f)
        if f != b"" and h is None:
            return name
        sparse.append(h)
    return Row(label, dense, sparse)


def reference(data: bytes, labels: bool = True) -> tuple[list[Row], list[Bad]]:
    """Lines end at LF; one CR before it is part of the line end; an empty line
    is a bad line (a wrong field count), for preprocess, predict and
    export.raw_inputs' items alike; the last line may lack its LF (a final LF
    ends the last line: no empty line after it)."""
    pieces = data.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()
    rows, bad = [], []
    for n, line in enumerate(pieces, 1):
        if line.endswith(b"\r"):
            line = line[:-1]
        r = ref_line(line, labels)  # an empty line: one field, a wrong count
        if isinstance(r, Row):
            rows.append(r)
        else:
            bad.append(Bad(n, r))
    return rows, bad


def ref_arrays(rows: list[Row]) -> dict[str, np.ndarray]:
    n = len(rows)
    dense_raw = np.array([r.dense for r in rows], dtype=np.int64).reshape(n, 13)
    return {
        "label": np.array([r.label for r in rows], dtype=np.float32) if rows and rows[0].label is not None
        else np.zeros(0, np.float32),
        "dense_raw": dense_raw,
        # log(1 + max(x, 0)), in float64 (math.log1p of the exact integer), rounded once to float32
        "dense": np.array([[math.log1p(max(x, 0)) for x in r.dense] for r in rows], dtype=np.float64)
        .astype(np.float32).reshape(n, 13),
        "present": np.array([[v is not None for v in r.sparse] for r in rows], dtype=bool).reshape(n, 26),
        "values": np.array([[v or 0 for v in r.sparse] for r in rows], dtype=np.int64).reshape(n, 26),
    }


# --------------------------------------------------------------------------- mutations


def value_text(kind: str, draw) -> bytes:
    if kind == "int":
        v = draw(st.one_of(st.integers(-5, 5000), st.integers(-(2**63), 2**63 - 1),
                           st.integers(-(2**70), 2**70)))
        pad = draw(st.sampled_from(["", " ", "  "]))
        return (draw(st.sampled_from(["", pad])) + str(v) + draw(st.sampled_from(["", pad]))).encode()
    if kind == "hex":
        v = draw(st.integers(0, 2**32 - 1))
        s = f"{v:08x}"
        return (s.upper() if draw(st.booleans()) else s).encode()
    if kind == "label":
        return draw(st.sampled_from([b"0", b"1", b"0.5", b"1.0", b"+1", b"-0", b"1e0", b".5", b"1.", b"0e5",
                                     b"1e-400", b"2", b"-1", b"1.0000001", b"0.99999999999", b" 1", b"0 ",
                                     b"nan", b"inf", b"1e999", b"+.5", b"-.0", b"1x"]))
    # strange things
    return draw(st.one_of(
        st.sampled_from([b"", b" ", b"-", b"+", b"+5", b"--5", b"- 5", b"0x10", b"0X7f", b"0xFFFFFFFFFFFFFFFF",
                         b"0x8000000000000000", b"1e3", b"1.5", b"inf", b"nan", b"NaN", b"9" * 19, b"9" * 25,
                         b"-" + b"9" * 19, b"9223372036854775807", b"-9223372036854775808",
                         b"9223372036854775808", b"1_000", b"\x00", b"5\x00", b"\xd9\xa5", b"\xd9\xa0",
                         "٣".encode(), "１２".encode(), "\u00a01".encode(), "\u20281".encode(),
                         "abcdéf01".encode(), b"abcdef0", b"abcdef012", b"0000abcd ", b" 0000abcd", b"-000abcd",
                         b"+000abcd", b"ABCDEF0G", b"\xff\xfe", b"0b1", b"0o7", b"\x0b", b"\x0c5", b"1\r", b"\r"]),
        st.binary(min_size=0, max_size=10),
        st.text(max_size=6).map(lambda s: s.encode("utf-8", "surrogatepass")),
    ))


INSERTS = [b"\t", b"\n", b"\r", b"\r\n", b"\x00", b" ", b"-", b"+", b".", b"e", b"x", b"\t\t", b"\n\n",
           "é".encode(), "٣".encode(), "\u2028".encode(), b"\xff", b"\x85", b"\x1c", b"\x1e"]


def good_row(seed: int, labels: bool = True) -> bytes:
    """A valid row, from one drawn seed (one draw a row keeps generation cheap)."""
    import random

    rng = random.Random(seed)
    fields = [b"01"[rng.getrandbits(1):][:1]] if labels else []
    for _ in range(13):
        fields.append(b"" if rng.random() < 0.1 else str(rng.randint(-3, 5000)).encode())
    for _ in range(26):
        fields.append(b"" if rng.random() < 0.1 else f"{rng.getrandbits(32):08x}".encode())
    return b"\t".join(fields)


@st.composite
def mutated_file(draw, labels: bool = True) -> bytes:
    """A few valid rows, mutated: the text of a file."""
    lines = [good_row(seed, labels) for seed in draw(st.lists(st.integers(0, 2**32), min_size=1, max_size=6))]
    nfields = 40 if labels else 39
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["replace", "replace", "replace", "add_field", "drop_field", "flip", "insert",
                                   "delete", "blank", "dup"]))
        i = draw(st.integers(0, len(lines) - 1))
        line = lines[i]
        fields = line.split(b"\t")
        if op == "replace":
            j = draw(st.integers(0, len(fields) - 1))
            col = j if len(fields) == nfields else -1
            first_dense = 1 if labels else 0
            kind = draw(st.sampled_from(
                ["weird", "weird"] + (["label"] if labels and col == 0 else [])
                + (["int"] if first_dense <= col < first_dense + 13 else [])
                + (["hex"] if col >= first_dense + 13 else [])))
            fields[j] = value_text(kind, draw)
            line = b"\t".join(fields)
        elif op == "add_field":
            j = draw(st.integers(0, len(fields)))
            fields.insert(j, value_text(draw(st.sampled_from(["int", "hex", "weird"])), draw))
            line = b"\t".join(fields)
        elif op == "drop_field":
            del fields[draw(st.integers(0, len(fields) - 1))]
            line = b"\t".join(fields)
        elif op == "flip" and line:
            j = draw(st.integers(0, len(line) - 1))
            line = line[:j] + bytes([draw(st.integers(0, 255))]) + line[j + 1:]
        elif op == "insert":
            j = draw(st.integers(0, len(line)))
            line = line[:j] + draw(st.sampled_from(INSERTS)) + line[j:]
        elif op == "delete" and line:
            j = draw(st.integers(0, len(line) - 1))
            line = line[:j] + line[j + draw(st.integers(1, 3)):]
        elif op == "blank":
            lines.insert(i, draw(st.sampled_from([b"", b"\r", b" ", b"\t"])))
            continue
        elif op == "dup":
            lines.insert(i, line)
            continue
        lines[i] = line
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    text = eol.join(lines)
    text = text + eol if draw(st.booleans()) else text
    # A file that starts with gzip's magic is read as gzip (criteo_input detects it):
    # not a text row to compare; test_a_text_file_with_gzips_magic_is_one_line holds it.
    assume(not text.startswith(GZIP_MAGIC))
    return text


# --------------------------------------------------------------------------- running the parsers


TMP = Path(tempfile.mkdtemp(prefix="parser-fuzz-"))  # one file rewritten per example (hypothesis and pytest's
atexit.register(shutil.rmtree, TMP, ignore_errors=True)  # function-scoped tmp_path do not mix)
# 300 bytes: a block a line (a row is about 330 bytes), lines straddling reads; 1024: a few lines a block
BLOCK_SIZES = st.sampled_from([300, 1024, 8 << 20, 8 << 20])


def write(data: bytes, name: str = "t.txt") -> Path:
    path = TMP / name
    path.write_bytes(data)
    return path


def one_line(message: str) -> None:
    assert "\n" not in message and "\r" not in message, repr(message)


def check_error(message: str, bad: Bad, path: str | None = "t.txt") -> None:
    """The error names the first bad line and its column (or the field count)."""
    one_line(message)
    where = f"{path} line {bad.line}" if path else f"line {bad.line}"
    assert re.search(re.escape(where) + r"\b", message), (message, bad)
    if bad.column is None:
        assert "tab-separated fields" in message, (message, bad)
    else:
        assert re.search(rf"column {bad.column}\b", message), (message, bad)


def decoded_arrays(blocks) -> dict[str, np.ndarray]:
    got: dict[str, list[np.ndarray]] = {"label": [], "dense_raw": [], "dense": [], "present": [], "values": []}
    for d in blocks:
        if d.rows == 0:
            continue
        if d.label is not None:
            got["label"].append(d.label)
        got["dense_raw"].append(d.dense_raw)
        got["dense"].append(d.dense)
        present = np.stack(d.present, axis=1)
        values = np.zeros((d.rows, 26), np.int64)
        for f in range(26):
            values[d.present[f], f] = d.values[f]
        got["present"].append(present)
        got["values"].append(values)
    empty = {"label": np.zeros(0, np.float32), "dense_raw": np.zeros((0, 13), np.int64),
             "dense": np.zeros((0, 13), np.float32), "present": np.zeros((0, 26), bool),
             "values": np.zeros((0, 26), np.int64)}
    return {k: np.concatenate(v) if v else empty[k] for k, v in got.items()}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], labels: bool = True) -> None:
    keys = ["dense_raw", "dense", "present", "values"] + (["label"] if labels else [])
    for k in keys:
        assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # bit for bit: the same float32s (-0.0 is a label too)
    assert got["dense"].tobytes() == want["dense"].tobytes()


def reader_blocks(path: Path, labels: bool, block_size: int, on_error: str):
    reader = BlockReader([path], labels=labels, block_size=block_size, on_error=on_error)
    skipped = 0
    out = []
    for ch in reader.chunks(want_dense=True):
        skipped += ch.skipped
        out.append(ch.decoded)
    return out, skipped


# --------------------------------------------------------------------------- the tests


GZIP_MAGIC = b"\x1f\x8b"


def test_a_text_file_with_gzips_magic_is_one_line(tmp_path):
    """A flipped first byte pair can make a text file look like gzip (the
    fuzzer found it): one line naming the file, not a row's error."""
    path = tmp_path / "t.txt"
    path.write_bytes(GZIP_MAGIC + good_row(1, True)[2:] + b"\n")
    with pytest.raises(UserError) as failed:
        reader_blocks(path, True, 1024, "raise")
    one_line(str(failed.value))
    assert str(failed.value).startswith(f"{path}: not valid gzip data"), failed.value


def check_raise(read, data: bytes, labels: bool, path: str | None = "t.txt") -> str | None:
    """Run `read` (-> arrays): the reference's values, or its first bad line
    and column named in a UserError (whose message is returned)."""
    rows, bad = reference(data, labels)
    try:
        got = read()
    except UserError as e:
        assert bad, f"valid input refused: {e}"
        check_error(str(e), bad[0], path)
        return str(e)
    assert not bad, f"accepted input with bad line {bad[0]}"
    assert_same(got, ref_arrays(rows), labels)
    return None


@FUZZ
@given(data=mutated_file(), block_size=BLOCK_SIZES)
def test_preprocess_reader(data, block_size):
    """preprocess's reading: on_error=raise gives the reference's values or
    names the first bad line and column; on_error=skip drops exactly the
    reference's bad lines and keeps the rest's values."""
    tried("preprocess reader, on_error=raise")
    path = write(data)

    def read():
        blocks, skipped = reader_blocks(path, True, block_size, "raise")
        assert skipped == 0
        return decoded_arrays(blocks)

    check_raise(read, data, True)
    rows, bad = reference(data)
    if not bad:  # on_error is only read for a bad line: the same reading as above
        return
    tried("preprocess reader, on_error=skip")
    blocks, skipped = reader_blocks(path, True, block_size, "skip")
    assert skipped == len(bad), (skipped, bad)
    assert_same(decoded_arrays(blocks), ref_arrays(rows))


def first_line(data: bytes) -> tuple[int, bytes] | None:
    """The reference's first non-empty line (1-based number, text without its line end)."""
    for n, line in enumerate(data.split(b"\n"), 1):
        line = line[:-1] if line.endswith(b"\r") else line
        if line:
            return n, line
    return None


@FUZZ
@given(labels=st.sampled_from([True, False, None]), data=st.data(), block_size=BLOCK_SIZES)
def test_predict_raw_rows(labels, data, block_size):
    """recsys predict's reading of raw rows, 40 or 39 fields, or as many as
    its first line has (labels unset, as predict's default), every row scored."""
    from data_tools.criteo_input import labelled

    tried("predict raw rows")
    text = data.draw(mutated_file(labels is not False))
    path = write(text)
    if labels is None:
        first = first_line(text)
        try:
            labels = labelled(path)
        except UserError as e:
            assert first is not None and first[1].count(b"\t") + 1 not in (39, 40), e
            check_error(str(e), Bad(first[0], None))
            return
        assert first is not None and labels == (first[1].count(b"\t") + 1 == 40)

    def read():
        return decoded_arrays(d for d, _ in decoded_blocks([path], labels=labels, block_size=block_size))

    message = check_raise(read, text, labels)
    assert message is None or "on_error=skip" not in message  # predict cannot skip a row


@CHEAP
@given(labels=st.booleans(), data=st.data(), as_str=st.booleans())
def test_raw_inputs(labels, data, as_str):
    """recsys_cli.export.raw_inputs: lines (str or bytes, line ends kept or not)
    -> the artifact's inputs, or a ValueError naming the line and column."""
    from recsys_cli.export import raw_inputs

    tried("export.raw_inputs")
    text = data.draw(mutated_file(labels))
    lines = text.split(b"\n")  # the items: one line each, its CR kept (a CRLF file's lines)
    if lines[-1] == b"":
        lines.pop()
    items: list = lines
    if as_str:
        try:
            items = [ln.decode("utf-8") for ln in lines]
        except UnicodeDecodeError:
            pass
    # raw_inputs tells labelled from unlabelled lines by the first line's field count (40 or not)
    first = next((ln[:-1] if ln.endswith(b"\r") else ln for ln in lines if ln not in (b"", b"\r")), b"")
    rows, bad = reference(text, first.count(b"\t") + 1 == 40)  # an empty item is a bad line: one row an item
    try:
        dense, categorical = raw_inputs(items)
    except ValueError as e:
        assert bad, f"valid input refused: {e}"
        check_error(str(e), bad[0], path=None)
        return
    assert not bad, f"accepted input with bad line {bad[0]}"
    want = ref_arrays(rows)
    np.testing.assert_array_equal(dense.numpy(), want["dense_raw"])
    np.testing.assert_array_equal(categorical.numpy(), np.where(want["present"], want["values"], -1))


def ref_ids(want: dict[str, np.ndarray], mode: str, buckets: int) -> np.ndarray:
    """The ids preprocess gives: hashing, 1 + value % (N - 1); a vocabulary
    (min_count 1), ids 1.. by descending count, ties by ascending value; missing 0."""
    present, values = want["present"], want["values"]
    if mode == "hash":
        return np.where(present, 1 + values % (buckets - 1), 0)
    ids = np.zeros_like(values)
    for f in range(values.shape[1]):
        counts: dict[int, int] = {}
        for v in values[present[:, f], f].tolist():
            counts[v] = counts.get(v, 0) + 1
        order = {v: i + 1 for i, v in enumerate(sorted(counts, key=lambda v: (-counts[v], v)))}
        ids[:, f] = [order[v] if p else 0 for v, p in zip(values[:, f].tolist(), present[:, f].tolist())]
    return ids


@FULL
@given(data=mutated_file(), on_error=st.sampled_from(["raise", "skip"]), block_size=st.sampled_from([1024, 8 << 20]),
       mode=st.sampled_from(["hash", "vocabulary, spill", "vocabulary, no spill"]))
def test_preprocess_end_to_end(data, on_error, block_size, mode):
    """preprocess() itself (hashing, or a vocabulary built in two passes with
    or without the spill; one split): the shard holds the reference's rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_tools.criteo import CriteoConfig, preprocess
    from data_tools.manifest import load_manifest

    tried("preprocess end to end")
    rows, bad = reference(data)
    path = write(data, "e2e.txt")
    out = TMP / "e2e-out"
    buckets = 1000
    cfg = CriteoConfig(input=str(path), output=str(out), hash_buckets=buckets if mode == "hash" else None,
                       spill=mode != "vocabulary, no spill", split_by="none", on_error=on_error,
                       block_size=block_size, progress=False)
    try:
        m = preprocess(cfg, console=_quiet())
    except UserError as e:
        assert bad or not rows, f"valid input refused: {e}"
        if bad and on_error == "raise":
            check_error(str(e), bad[0], path="e2e.txt")
        else:
            assert "no valid rows" in str(e)
        return
    assert rows, "a dataset without rows"
    assert on_error == "skip" or not bad, f"accepted input with bad line {bad[0]}"
    assert m.skipped_lines == len(bad)
    t = pa.concat_tables([pq.read_table(out / s.file) for s in load_manifest(out).splits["all"].shards])
    want = ref_arrays(rows)
    np.testing.assert_array_equal(t["label"].to_numpy(), want["label"])
    dense = np.stack(t["dense"].to_numpy(zero_copy_only=False)).astype(np.float32)
    assert dense.tobytes() == want["dense"].tobytes()
    ids = np.stack([t[c].to_numpy() for c in SPARSE], axis=1)
    np.testing.assert_array_equal(ids, ref_ids(want, mode, buckets))


def _quiet():
    """A console that prints nothing (preprocess's summary, once an example)."""
    import io

    from rich.console import Console

    return Console(file=io.StringIO())


# --------------------------------------------------------------------------- the reference, checked by hand


@pytest.mark.parametrize("text,ok", [
    (b"1" + b"\t5" * 13 + b"\t0000abcd" * 26, True),
    (b" +.5 " + b"\t -5 " * 13 + b"\tABCDEF01" * 26, True),
    (b"1" + b"\t" * 39, True),
    (b"1" + b"\t0x10" + b"\t5" * 12 + b"\t0000abcd" * 26, False),  # no hex integers
    (b"1" + b"\t+5" + b"\t5" * 12 + b"\t0000abcd" * 26, False),
    (b"1" + b"\t9223372036854775808" + b"\t5" * 12 + b"\t" * 26, False),
    (b"\xd9\xa0" + b"\t" * 39, False),  # an Arabic-Indic zero is not a label
    (b"1" + b"\t5" * 13 + b"\t0000abcd" * 25 + b"\t0000abc\r", False),
    (b"1.0000001" + b"\t" * 39, False),
    (b"", False),  # an empty line
    (b"\r", False),  # an empty line of a CRLF file
])
def test_reference_parser_by_hand(text, ok):
    rows, bad = reference(text + b"\n")
    assert (len(rows), len(bad)) == ((1, 0) if ok else (0, 1))


def test_cases_tried():
    """Runs last in this file: the number of cases tried (printed under pytest -s),
    and a check that the fuzz tests above did run their examples."""
    total = sum(CASES.values())
    print(f"\nparser fuzz: {total} cases tried: " + ", ".join(f"{k} {v}" for k, v in CASES.items()))
    if len(CASES) == 5:  # the whole file ran: each test ran at least its examples (skip runs on bad inputs only)
        assert CASES["preprocess reader, on_error=raise"] >= FUZZ.max_examples, CASES
        assert CASES["predict raw rows"] >= FUZZ.max_examples, CASES
        assert CASES["export.raw_inputs"] >= CHEAP.max_examples, CASES
        assert CASES["preprocess end to end"] >= FULL.max_examples, CASES
