"""One block of Criteo TSV text -> checked arrays; and why a bad line is bad.

A block is whole lines (LF or CRLF). BlockParser parses it with pyarrow.csv
(C* columns as raw bytes), checks it with vectorised tests and decodes the hex
values with a 65536-entry table that maps two ASCII characters to a byte or
flags them as invalid; a block that fails any check raises BadBlock, and the
reader (criteo_input.py) then finds its bad lines with the line-level regular
expressions and `diagnose_line`, which says which column is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from data_tools.manifest import CRITEO_DENSE, CRITEO_SPARSE, NUM_DENSE

COLUMNS = ["label", *CRITEO_DENSE, *CRITEO_SPARSE]
NUM_COLUMNS = len(COLUMNS)  # 40
NUM_SPARSE = len(CRITEO_SPARSE)


def _hex_table() -> np.ndarray:
    """uint16 index (two ASCII bytes, little-endian as numpy views them) ->
    the byte they spell in hex, or 0x100 when either is not a hex digit."""
    nib = np.full(256, 0x100, dtype=np.int32)
    for i, c in enumerate(b"0123456789abcdef"):
        nib[c] = i
    for i, c in enumerate(b"ABCDEF"):
        nib[c] = 10 + i
    lo = np.arange(65536) & 0xFF  # first character (lower address)
    hi = np.arange(65536) >> 8  # second character
    a, b = nib[lo], nib[hi]
    out = (a << 4) | b
    out[(a > 15) | (b > 15)] = 0x100
    return out.astype(np.uint16)


_HEX16 = _hex_table()


def dense_log1p(raw: np.ndarray) -> np.ndarray:
    """The dense features' transform: float32 log(1 + max(x, 0)) of the raw
    integers, computed in float64 and rounded once. float32 log1p is not
    correctly rounded and numpy's and torch's differ on about 560k of the
    integers 0..2^24; in float64 they agree (the export's program computes
    the same in torch: recsys_cli/export.py, tested on 0..2^22 and random
    values < 2^62)."""
    return np.log1p(np.maximum(raw, 0).astype(np.float64)).astype(np.float32)


class BadBlock(Exception):
    pass


def _as_bytes(data) -> tuple[bytes, int, int]:
    """(a bytes object, start, end) holding `data` without a copy where it is
    bytes or a memoryview of bytes (text_blocks' blocks), so that bytes.find
    (memchr) can scan it."""
    if isinstance(data, bytes):
        return data, 0, len(data)
    if isinstance(data, memoryview) and isinstance(data.obj, bytes) and data.contiguous and data.itemsize == 1:
        start = np.frombuffer(data, np.uint8).ctypes.data - np.frombuffer(data.obj, np.uint8).ctypes.data
        return data.obj, start, start + data.nbytes
    b = bytes(data)
    return b, 0, len(b)


def _check_bytes(data) -> None:
    """What Arrow's reader would take but the format does not allow: an x or X
    anywhere (Arrow reads I*=0x10 as 16 and 0xFFFFFFFFFFFFFFFF as -1; no valid
    field holds one), a UTF-8 byte order mark, and a CR not followed by LF (Arrow ends a row there, so
    one line read as two rows, or a stray CR next to a line end vanished); a
    CR that ends the text is a last line's line end without its LF. Three
    memchr scans, under 1 ms for 9 MB (a block's parse is 30-60 ms); a file
    with CRs (CRLF) also pays a vectorised look at the byte after each CR."""
    text, start, end = _as_bytes(data)
    if text.find(b"x", start, end) >= 0 or text.find(b"X", start, end) >= 0:
        raise BadBlock("x in a field")
    if text.find(b"\xef\xbb\xbf", start, end) >= 0:
        # a byte order mark (the reader drops one that starts a file): Arrow skips one that starts the
        # text it parses and no other, so a line starting with one passed at a block's start, failed
        # inside a block, and the block's bad line was never found ("input changed while ...")
        raise BadBlock("byte order mark")
    if text.find(b"\r", start, end) >= 0:
        t = np.frombuffer(text, np.uint8, count=end - start, offset=start)
        cr = np.flatnonzero(t[:-1] == ord("\r"))
        if cr.size and (t[cr + 1] != ord("\n")).any():
            raise BadBlock("CR without LF")


@dataclass
class DecodedBlock:
    rows: int
    label: np.ndarray | None  # float32 [n]
    dense: np.ndarray | None  # float32 [n, 13]: dense_log1p(dense_raw)
    values: list[np.ndarray]  # per sparse feature: uint32 values of present rows
    present: list[np.ndarray]  # per sparse feature: bool [n]
    dense_raw: np.ndarray | None = None  # int64 [n, 13], the integers as written (missing -> 0)


def decode_hex(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    n = len(arr)
    if n == 0:
        return np.zeros(0, np.uint32), np.zeros(0, bool)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32, count=n + 1, offset=arr.offset * 4)
    lengths = np.diff(offsets)
    present = lengths == 8
    if not (present | (lengths == 0)).all():
        raise BadBlock("C value of wrong length")
    start, end = int(offsets[0]), int(offsets[-1])
    if end == start:
        return np.zeros(0, np.uint32), present
    data = np.frombuffer(bufs[2], dtype=np.uint8, count=end - start, offset=start)
    pairs = np.take(_HEX16, data.view(np.uint16))
    if pairs.max() > 0xFF:
        raise BadBlock("non-hex C value")
    return pairs.astype(np.uint8).view(">u4").astype(np.uint32), present


def int_column(arr: pa.Array) -> np.ndarray:
    n = len(arr)
    v = np.frombuffer(arr.buffers()[1], dtype=np.int64, count=n, offset=arr.offset * 8)
    if arr.null_count:
        valid = np.unpackbits(
            np.frombuffer(arr.buffers()[0], dtype=np.uint8), bitorder="little", count=arr.offset + n
        )[arr.offset:].astype(bool)
        v = np.where(valid, v, 0)
    return v


def _arrow_owned(data) -> pa.Buffer:
    """A copy of `data` in memory arrow allocated. The threaded CSV reader
    drops its last reference to its input on one of arrow's worker threads,
    after read_csv has returned; a buffer wrapping a Python object
    (pa.py_buffer) then takes the GIL to release it, and if the interpreter
    is exiting meanwhile that thread is unwound inside a noexcept destructor:
    std::terminate, SIGABRT at exit ("terminate called without an active
    exception", issue 40 problem 6). Memory of arrow's own pool is freed
    without the GIL. The copy costs a memcpy of the block."""
    out = pa.BufferOutputStream()
    out.write(data)
    return out.getvalue()


class BlockParser:
    def __init__(self, *, labels: bool = True, label_int8: bool = False, block_size: int = 8 << 20):
        """labels: the first field is the label (40 fields, else 39); label_int8:
        labels must be 0 or 1; block_size: bytes of text in a block."""
        self.label_int8 = label_int8
        self.labels = labels
        self.first_dense = 1 if labels else 0  # column index of I1
        self.read_options = pacsv.ReadOptions(
            column_names=COLUMNS[1 - self.first_dense:], block_size=max(1 << 20, block_size // 4),
            use_threads=True,
        )
        self.parse_options = pacsv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False)
        types = {"label": pa.float32()} if labels else {}
        types.update({c: pa.int64() for c in CRITEO_DENSE})
        types.update({c: pa.binary() for c in CRITEO_SPARSE})
        self.convert_options = pacsv.ConvertOptions(
            column_types=types,
            null_values=[""],
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
        )

    def parse(self, data, want_dense: bool, lines: int | None = None) -> DecodedBlock:
        """Parse and check one block of whole lines; BadBlock if any line is bad.
        lines: how many lines `data` holds (its line ends, and one for a last line
        without one). Arrow skips an empty line (told not to, it reads a row of
        nulls: a valid unlabelled row), so a row went missing uncounted; with
        `lines` given, fewer rows than lines is an empty line, a bad line like
        any other. Without it, an empty line is skipped (callers that drop bad
        lines, or have no empty ones)."""
        buf = _arrow_owned(data)
        if buf.size == 0:  # no rows (every line of a block skipped as bad, or blank): arrays of 0 rows
            return DecodedBlock(0, np.zeros(0, np.float32) if self.labels else None,
                                np.zeros((0, NUM_DENSE), np.float32) if want_dense else None,
                                [np.zeros(0, np.uint32)] * NUM_SPARSE, [np.zeros(0, bool)] * NUM_SPARSE,
                                np.zeros((0, NUM_DENSE), np.int64) if want_dense else None)
        _check_bytes(data)
        try:
            table = pacsv.read_csv(buf, self.read_options, self.parse_options, self.convert_options)
        except pa.ArrowInvalid as e:
            if "Empty CSV file" in str(e):
                if lines:
                    raise BadBlock("empty line") from None
                return self.parse(b"", want_dense)
            raise BadBlock(str(e)) from None
        table = table.combine_chunks()
        n = table.num_rows
        if lines is not None and n != lines:
            raise BadBlock("empty line")
        label = None
        if self.labels:
            label_col = table.column(0).chunk(0) if table.column(0).num_chunks else pa.array([], pa.float32())
            if label_col.null_count:
                raise BadBlock("empty label")
            label = label_col.to_numpy(zero_copy_only=False)
            if n and not ((label >= 0) & (label <= 1)).all():
                raise BadBlock("label out of range")
            if self.label_int8 and n and not np.isin(label, (0.0, 1.0)).all():
                raise BadBlock("label not 0/1")
            label = label.astype(np.float32, copy=False)
        dense = dense_raw = None
        if want_dense:
            dense_raw = np.empty((n, NUM_DENSE), dtype=np.int64)
            for j in range(NUM_DENSE):
                col = table.column(self.first_dense + j)
                dense_raw[:, j] = int_column(col.chunk(0)) if col.num_chunks else np.zeros(0, np.int64)
            dense = dense_log1p(dense_raw)
        values, present = [], []
        for f in range(NUM_SPARSE):
            col = table.column(self.first_dense + NUM_DENSE + f)
            v, p = decode_hex(col.chunk(0)) if col.num_chunks else (np.zeros(0, np.uint32), np.zeros(0, bool))
            values.append(v)
            present.append(p)
        return DecodedBlock(n, label, dense, values, present, dense_raw)


# --------------------------------------------------------------------------- line-level checks

_INT = r"[ ]*-?[0-9]+[ ]*"
_HEXV = r"[0-9a-fA-F]{8}"
LINE_RE = re.compile(
    rb"[ ]*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[ ]*"
    + b"".join(b"\t(?:" + _INT.encode() + b")?" for _ in range(NUM_DENSE))
    + b"".join(b"\t(?:" + _HEXV.encode() + b")?" for _ in range(NUM_SPARSE))
)
# Unlabelled input (labels=false): the same line without the label field.
UNLABELLED_LINE_RE = re.compile(
    b"(?:" + _INT.encode() + b")?"
    + b"".join(b"\t(?:" + _INT.encode() + b")?" for _ in range(NUM_DENSE - 1))
    + b"".join(b"\t(?:" + _HEXV.encode() + b")?" for _ in range(NUM_SPARSE))
)


UNLABELLED = ("the input looks unlabelled (13 integer and 26 hex fields, no label, like Criteo's test.txt); "
              "preprocess builds training data and needs the label as the first field "
              "(to score it: recsys predict checkpoint=RUN input=FILE; to map it with a trained "
              "vocabulary: labels=false vocab=DIR)")


def _looks_unlabelled(fields: list[str]) -> bool:
    """39 fields that are I1..I13 and C1..C26: a label-less line, not a damaged one."""
    return (len(fields) == NUM_COLUMNS - 1
            and all(v == "" or re.fullmatch(r" *-?[0-9]+ *", v) for v in fields[:NUM_DENSE])
            and all(v == "" or re.fullmatch(r"[0-9a-fA-F]{8}", v) for v in fields[NUM_DENSE:]))


# The same line where a line is scored (recsys predict, export.raw_inputs): preprocess's advice (score it
# with predict) is no help there; the input's layout comes from labels= or its first line.
UNLABELLED_SCORED = ("the line looks unlabelled (13 integer and 26 hex fields, no label) where the input is read as "
                     "labelled (labels=true, or told from the first line): score labelled and unlabelled lines "
                     "separately (recsys predict: labels=false for unlabelled ones)")


def diagnose_line(line: bytes, label_int8: bool, labels: bool = True, unlabelled: str = UNLABELLED) -> str:
    """Why a line is bad: 'column X: ...' (or a generic reason); `unlabelled`
    is what to say of a 39-field line where 40 were expected."""
    text = line.decode("utf-8", errors="replace")
    if not text:
        return f"an empty line (expected {NUM_COLUMNS if labels else NUM_COLUMNS - 1} tab-separated fields)"
    fields = text.split("\t")
    if not labels:
        if len(fields) != NUM_COLUMNS - 1:
            hint = " (a labelled line? drop labels=false)" if len(fields) == NUM_COLUMNS else ""
            return f"expected {NUM_COLUMNS - 1} tab-separated fields (labels=false), found {len(fields)}{hint}"
        fields = ["0", *fields]
    elif len(fields) != NUM_COLUMNS:
        if _looks_unlabelled(fields):
            return f"expected {NUM_COLUMNS} tab-separated fields, found {len(fields)}: {unlabelled}"
        return f"expected {NUM_COLUMNS} tab-separated fields, found {len(fields)}"
    lab = fields[0]
    try:
        # ASCII only: \s and \d would take a CR, a form feed or an Arabic-Indic zero (float() reads those)
        x = float(lab) if re.fullmatch(r"[ ]*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?[ ]*", lab) else None
    except ValueError:
        x = None
    if x is None:
        return f"column label: {lab!r} is not a number"
    if not 0 <= x <= 1 or (label_int8 and x not in (0.0, 1.0)):
        return f"column label: {lab!r} is not {'0 or 1' if label_int8 else 'in [0, 1]'}"
    for name, v in zip(CRITEO_DENSE, fields[1:1 + NUM_DENSE]):
        if v == "":
            continue
        if not re.fullmatch(r" *-?[0-9]+ *", v) or not -(2**63) <= int(v) < 2**63:
            return f"column {name}: {v!r} is not an integer"
    for name, v in zip(CRITEO_SPARSE, fields[1 + NUM_DENSE:]):
        if v != "" and not re.fullmatch(r"[0-9a-fA-F]{8}", v):
            return f"column {name}: {v!r} is not 8 hex digits"
    return "the line could not be parsed"


def split_lines(block: bytes) -> list[bytes]:
    lines = block.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def strip_cr(line: bytes) -> bytes:
    return line[:-1] if line.endswith(b"\r") else line


def label_ok(line: bytes, int8: bool) -> bool:
    tab = line.find(b"\t")
    try:
        x = float(line[:tab] if tab >= 0 else line)
    except ValueError:
        return False
    return 0 <= x <= 1 and (not int8 or x in (0.0, 1.0))


def join_lines(lines: list[bytes], drop: set[int]) -> bytes:
    kept = [ln for i, ln in enumerate(lines) if i not in drop]
    return b"\n".join(kept) + b"\n" if kept else b""
