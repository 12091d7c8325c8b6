"""`recsys preprocess criteo`: raw Criteo TSV -> parquet shards + manifest.

Input: Criteo's raw format (Kaggle train.txt, Terabyte day_0..day_23): one
sample a line, 40 tab-separated fields, no header: label, I1..I13 (integers,
may be negative, may be empty), C1..C26 (8 hex digits, i.e. a 32-bit hash, may
be empty). LF or CRLF line endings; plain or gzip (detected from the file's
first bytes); several files (a list or a glob, taken in natural order:
day_2 before day_10) are read as one sequence of rows. Blank lines are
ignored (they count for line numbers only).

Ids (per sparse feature, in [0, vocab_size)):
  * vocabulary mode (default, two passes). Pass 1 counts every value's
    occurrences. Values seen at least `min_count` times are "frequent" and get
    ids 1..V-1 in order of descending count, ties broken by ascending value
    (the 32-bit number the hex digits spell). Missing values and values seen
    fewer than `min_count` times share id 0. vocab_size = V = 1 + #frequent.
    The mapping is saved with the shards (data_tools/vocab.py: vocab/*.npy,
    sorted values and their ids).
  * hashing mode (`hash_buckets=N`, N >= 2, one pass, no counting):
    id = 1 + value % (N - 1); missing -> 0; vocab_size = N for every feature.
  * existing vocabulary (`vocab=DIR`, one pass): DIR's saved mapping;
    values it has no id for -> 0, counted per feature
    (manifest.options.unknown_values); the vocabulary is copied along.
Unlabelled input (`labels=false`): 39 fields, no label; no label column.
Dense: log(1 + max(x, 0)) as float32, missing -> 0. Label: float32 (or int8
with label_dtype=int8); must be in [0, 1] (0 or 1 for int8).

Splits (rows in input order, after dropping skipped lines):
  * split=kaggle (default): DLRM's. 7 equal "days" (total // 7 rows each, the
    first total % 7 days one row more); train = days 0-5; the last day is
    halved as numpy.array_split does: first (larger) half test, second half val.
  * split=ratios ratios=[a,b,c]: consecutive train/val/test ranges in proportion.
  * split=none: one split, "all", of every row.
  In the one-pass modes the row count is known only at the end: rows are staged in
  file order and moved (or, for the at most two files that straddle a split
  boundary, rewritten) into their split.

Bad lines (wrong field count, a label that is not a number in [0, 1], a
non-integer I*, a C* that is not 8 hex digits): with on_error=raise (default)
the run stops with a UserError naming the file, the 1-based line number in
that file and the column; with on_error=skip they are dropped and counted
(manifest.skipped_lines). Integers are parsed by Arrow's parser, which also
tolerates surrounding spaces and a 0x prefix.

Hex digits may be upper or lower case.

How it runs: one thread reads (and gunzips) blocks of `block_size` bytes cut
at line ends, another parses them with pyarrow.csv (C* as raw bytes) and
decodes the hex with a 65536-entry table that maps two ASCII characters to a
byte or flags them as invalid; the main thread counts values in vectorised
open-addressing hash tables (one per feature, uint32 keys), so memory grows
with the number of distinct values, not with rows. A block that fails the
vectorised checks is re-scanned line by line to find the bad lines. With
spill=true (default) pass 1 also writes the parsed rows, with each value
replaced by its first-seen index, to an Arrow file inside the temporary
output directory (about 160 bytes a row); pass 2 maps those indices to ids
with one array lookup and writes the shards, without parsing the text again.
spill=false re-reads and re-parses the input in pass 2 instead.
"""

from __future__ import annotations

import bisect
import dataclasses
import glob as globmod
import math
import os
import re
import shutil
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from data_tools import shards as sh
from data_tools import vocab as vocab_io
from data_tools.background import BackgroundIterator
from data_tools.manifest import (
    CRITEO_DENSE,
    CRITEO_SPARSE,
    NUM_DENSE,
    SPLITS,
    Manifest,
    SparseFeature,
    Split,
)
from data_tools.errors import UserError

COLUMNS = ["label", *CRITEO_DENSE, *CRITEO_SPARSE]
NUM_COLUMNS = len(COLUMNS)  # 40
NUM_SPARSE = len(CRITEO_SPARSE)
ALL_SPLIT = "all"  # the one split of split=none


@dataclass
class CriteoConfig:
    # A path, a glob ("day_*.gz") or a list of paths/globs.
    input: Any = None
    output: Optional[str] = None
    min_count: int = 1
    hash_buckets: Optional[int] = None
    label_dtype: str = "float32"  # float32 | int8
    split: str = "kaggle"  # kaggle | ratios | none (one split, "all", of every row)
    ratios: list[float] = field(default_factory=lambda: [0.8, 0.1, 0.1])
    on_error: str = "raise"  # raise | skip
    row_group_rows: int = sh.DEFAULT_ROW_GROUP_ROWS
    shard_rows: int = sh.DEFAULT_SHARD_ROWS
    compression: str = "snappy"
    block_size: int = 8 << 20  # bytes of text parsed at a time
    # Vocabulary mode: keep pass 1's parsed rows in a temporary Arrow file in
    # the output's temporary directory (about 160 bytes a row) so that pass 2
    # does not parse the text again; false: pass 2 re-reads the input.
    spill: bool = True
    # Map values with this dataset's saved vocabulary (a `recsys preprocess`
    # output) in one pass instead of building one; unseen values -> id 0.
    vocab: Optional[str] = None
    # false: 39-column input without the label column (Criteo's test.txt).
    labels: bool = True
    progress: bool = True


# --------------------------------------------------------------------------- hash table


class U32Map:
    """Open-addressing (linear probing) hash table from uint32 keys to
    integer values, operated on whole numpy arrays at a time. Slots hold
    key + 1 as uint64 (0 = empty), so one gather tells hit, miss and empty.
    With track_order, every key also gets its insertion index (0, 1, ...),
    which stays fixed when the table grows."""

    _GOLD = np.uint64(0x9E3779B97F4A7C15)
    MAX_LOAD = 0.6

    def __init__(self, capacity: int = 1024, dtype=np.int64, track_order: bool = False):
        bits = max(4, int(math.ceil(math.log2(max(capacity, 16)))))
        self.track_order = track_order
        self._alloc(bits, dtype)
        self.size = 0

    def _alloc(self, bits: int, dtype) -> None:
        self.bits = bits
        self.cap = 1 << bits
        self.mask = self.cap - 1
        self.slots = np.zeros(self.cap, dtype=np.uint64)  # key + 1, 0 = empty
        self.vals = np.zeros(self.cap, dtype=dtype)
        self.order = np.zeros(self.cap, dtype=np.int32) if self.track_order else None

    def _prep(self, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        v64 = v.astype(np.uint64)
        pos = ((v64 * self._GOLD) >> np.uint64(64 - self.bits)).view(np.int64)
        v64 += np.uint64(1)
        return v64, pos

    _WINDOW = np.arange(16, dtype=np.int64)

    def find(self, v: np.ndarray) -> np.ndarray:
        """Slot of each key, -1 where absent."""
        k1, pos = self._prep(v)
        got = self.slots[pos]
        hit = got == k1
        if hit.all():
            return pos
        out = np.where(hit, pos, -1)
        idx = np.flatnonzero(~hit & (got != 0))
        pos, kk = pos[idx] + 1, k1[idx]
        # Collisions: look at the next 16 slots at once (linear probing keeps
        # a key within its cluster), until a hit or an empty slot.
        while idx.size:
            win = (pos[:, None] + self._WINDOW) & self.mask
            got = self.slots[win]
            hit = got == kk[:, None]
            stop = hit | (got == 0)
            first = stop.argmax(axis=1)
            rows = np.arange(len(idx))
            stopped = stop[rows, first]
            found = stopped & hit[rows, first]
            out[idx[found]] = win[rows[found], first[found]]
            cont = ~stopped
            idx, pos, kk = idx[cont], pos[cont] + len(self._WINDOW), kk[cont]
        return out

    def _place(self, keys: np.ndarray, vals: np.ndarray | None, order: np.ndarray | None = None) -> np.ndarray:
        """Insert unique keys known to be absent; returns their slots.
        `order`: their insertion indices (default: the next ones)."""
        n = len(keys)
        if self.order is not None and order is None:
            order = np.arange(self.size, self.size + n, dtype=np.int32)
        out = np.empty(n, dtype=np.int64)
        k1, pos = self._prep(keys)
        pending = np.arange(n)
        single = True  # first try each key's own slot, then windows of 16
        while pending.size:
            if single:
                has = self.slots[pos] == 0
                target = pos
            else:
                win = (pos[:, None] + self._WINDOW) & self.mask
                empty = self.slots[win] == 0
                first = empty.argmax(axis=1)
                rows = np.arange(len(pending))
                has = empty[rows, first]
                target = win[rows, first]
            cand = np.flatnonzero(has)
            # Claim empty slots: when keys race for one slot the last write
            # wins; reading back tells the winners (keys are unique).
            tc = target[cand]
            self.slots[tc] = k1[cand]
            won = np.zeros(len(pending), dtype=bool)
            won[cand[self.slots[tc] == k1[cand]]] = True
            w = np.flatnonzero(won)
            if vals is not None:
                self.vals[target[w]] = vals[pending[w]]
            if self.order is not None:
                self.order[target[w]] = order[pending[w]]
            out[pending[w]] = target[w]
            keep = ~won
            # losers retry from the slot they lost; keys without an empty slot
            # in their window move on by a whole window
            step = 1 if single else len(self._WINDOW)
            nxt = np.where(has, target, pos + step) & self.mask
            pending, pos, k1 = pending[keep], nxt[keep], k1[keep]
            single = False
        self.size += n
        return out

    def _grow_for(self, extra: int) -> None:
        need = self.size + extra
        if need <= self.MAX_LOAD * self.cap:
            return
        bits = self.bits
        while need > self.MAX_LOAD * (1 << bits):
            bits += 1
        used = self.slots != 0
        old_keys, old_vals = self.items()
        old_order = self.order[used] if self.order is not None else None
        self._alloc(bits, self.vals.dtype)
        self.size = 0
        if len(old_keys):
            self._place(old_keys, old_vals, old_order)

    def insert(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Insert unique, absent keys with values."""
        self._grow_for(len(keys))
        self._place(np.asarray(keys, dtype=np.uint32), vals)

    def count(self, v: np.ndarray) -> np.ndarray | None:
        """Add one to the value of each key in v (keys are added as needed);
        with track_order, returns each key's insertion index."""
        if not len(v):
            return np.zeros(0, np.int32) if self.order is not None else None
        slots = self.find(v)
        missing = slots < 0
        if missing.any():
            new = np.unique(v[missing])
            cap = self.cap
            self._grow_for(len(new))
            self._place(new, None)
            if self.cap != cap:  # rebuilt: every slot moved
                slots = self.find(v)
            else:
                slots[missing] = self.find(v[missing])
        if self.cap <= 8 * len(v):
            self.vals += np.bincount(slots, minlength=self.cap).astype(self.vals.dtype, copy=False)
        else:
            np.add.at(self.vals, slots, 1)
        return self.order[slots] if self.order is not None else None

    def get(self, v: np.ndarray, default: int = 0) -> np.ndarray:
        slots = self.find(v)
        found = slots >= 0
        if found.all():
            return self.vals[slots]
        return np.where(found, self.vals[np.maximum(slots, 0)], default)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        used = self.slots != 0
        return (self.slots[used] - np.uint64(1)).astype(np.uint32), self.vals[used]

    def items_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        used = self.slots != 0
        return (self.slots[used] - np.uint64(1)).astype(np.uint32), self.vals[used], self.order[used]


# --------------------------------------------------------------------------- decoding


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


class _BadBlock(Exception):
    pass


@dataclass
class _Decoded:
    rows: int
    label: np.ndarray | None  # float32 [n]
    dense: np.ndarray | None  # float32 [n, 13]
    values: list[np.ndarray]  # per sparse feature: uint32 values of present rows
    present: list[np.ndarray]  # per sparse feature: bool [n]


def _decode_hex(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    n = len(arr)
    if n == 0:
        return np.zeros(0, np.uint32), np.zeros(0, bool)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32, count=n + 1, offset=arr.offset * 4)
    lengths = np.diff(offsets)
    present = lengths == 8
    if not (present | (lengths == 0)).all():
        raise _BadBlock("C value of wrong length")
    start, end = int(offsets[0]), int(offsets[-1])
    if end == start:
        return np.zeros(0, np.uint32), present
    data = np.frombuffer(bufs[2], dtype=np.uint8, count=end - start, offset=start)
    pairs = np.take(_HEX16, data.view(np.uint16))
    if pairs.max() > 0xFF:
        raise _BadBlock("non-hex C value")
    return pairs.astype(np.uint8).view(">u4").astype(np.uint32), present


def _int_column(arr: pa.Array) -> np.ndarray:
    n = len(arr)
    v = np.frombuffer(arr.buffers()[1], dtype=np.int64, count=n, offset=arr.offset * 8)
    if arr.null_count:
        valid = np.unpackbits(
            np.frombuffer(arr.buffers()[0], dtype=np.uint8), bitorder="little", count=arr.offset + n
        )[arr.offset:].astype(bool)
        v = np.where(valid, v, 0)
    return v


class _Parser:
    def __init__(self, cfg: CriteoConfig):
        self.label_int8 = cfg.label_dtype == "int8"
        self.labels = cfg.labels
        self.first_dense = 1 if cfg.labels else 0  # column index of I1
        self.read_options = pacsv.ReadOptions(
            column_names=COLUMNS[1 - self.first_dense:], block_size=max(1 << 20, cfg.block_size // 4),
            use_threads=True,
        )
        self.parse_options = pacsv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False)
        types = {"label": pa.float32()} if cfg.labels else {}
        types.update({c: pa.int64() for c in CRITEO_DENSE})
        types.update({c: pa.binary() for c in CRITEO_SPARSE})
        self.convert_options = pacsv.ConvertOptions(
            column_types=types,
            null_values=[""],
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
        )

    def parse(self, data, want_dense: bool) -> _Decoded:
        """Parse and check one block of whole lines; _BadBlock if any line is bad."""
        buf = pa.py_buffer(data)
        if buf.size == 0:
            return _Decoded(0, None, None, [np.zeros(0, np.uint32)] * NUM_SPARSE, [np.zeros(0, bool)] * NUM_SPARSE)
        try:
            table = pacsv.read_csv(buf, self.read_options, self.parse_options, self.convert_options)
        except pa.ArrowInvalid as e:
            if "Empty CSV file" in str(e):
                return self.parse(b"", want_dense)
            raise _BadBlock(str(e)) from None
        table = table.combine_chunks()
        n = table.num_rows
        label = None
        if self.labels:
            label_col = table.column(0).chunk(0) if table.column(0).num_chunks else pa.array([], pa.float32())
            if label_col.null_count:
                raise _BadBlock("empty label")
            label = label_col.to_numpy(zero_copy_only=False)
            if n and not ((label >= 0) & (label <= 1)).all():
                raise _BadBlock("label out of range")
            if self.label_int8 and n and not np.isin(label, (0.0, 1.0)).all():
                raise _BadBlock("label not 0/1")
            label = label.astype(np.float32, copy=False)
        dense = None
        if want_dense:
            dense = np.empty((n, NUM_DENSE), dtype=np.float32)
            for j in range(NUM_DENSE):
                col = table.column(self.first_dense + j)
                x = _int_column(col.chunk(0)) if col.num_chunks else np.zeros(0, np.int64)
                np.log1p(np.maximum(x, 0).astype(np.float32), out=dense[:, j])
        values, present = [], []
        for f in range(NUM_SPARSE):
            col = table.column(self.first_dense + NUM_DENSE + f)
            v, p = _decode_hex(col.chunk(0)) if col.num_chunks else (np.zeros(0, np.uint32), np.zeros(0, bool))
            values.append(v)
            present.append(p)
        return _Decoded(n, label, dense, values, present)


# --------------------------------------------------------------------------- line-level checks

_INT = r"[ ]*-?[0-9]+[ ]*"
_HEXV = r"[0-9a-fA-F]{8}"
_LINE_RE = re.compile(
    rb"[ ]*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[ ]*"
    + b"".join(b"\t(?:" + _INT.encode() + b")?" for _ in range(NUM_DENSE))
    + b"".join(b"\t(?:" + _HEXV.encode() + b")?" for _ in range(NUM_SPARSE))
)
# Unlabelled input (labels=false): the same line without the label field.
_UNLABELLED_LINE_RE = re.compile(
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


def _diagnose(line: bytes, label_int8: bool, labels: bool = True) -> str:
    """Why a line is bad: 'column X: ...' (or a generic reason)."""
    text = line.decode("utf-8", errors="replace")
    fields = text.split("\t")
    if not labels:
        if len(fields) != NUM_COLUMNS - 1:
            hint = " (a labelled line? drop labels=false)" if len(fields) == NUM_COLUMNS else ""
            return f"expected {NUM_COLUMNS - 1} tab-separated fields (labels=false), found {len(fields)}{hint}"
        fields = ["0", *fields]
    elif len(fields) != NUM_COLUMNS:
        if _looks_unlabelled(fields):
            return f"expected {NUM_COLUMNS} tab-separated fields, found {len(fields)}: {UNLABELLED}"
        return f"expected {NUM_COLUMNS} tab-separated fields, found {len(fields)}"
    lab = fields[0]
    try:
        x = float(lab) if re.fullmatch(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*", lab) else None
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


def _split_lines(block: bytes) -> list[bytes]:
    lines = block.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def _strip_cr(line: bytes) -> bytes:
    return line[:-1] if line.endswith(b"\r") else line


# --------------------------------------------------------------------------- reading


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def resolve_inputs(spec: Any) -> list[Path]:
    """Paths named by `input`: a path, a glob, or a list of those."""
    if spec is None or spec == "" or spec == []:
        raise UserError("input=PATH is required (a file, a glob like 'day_*.gz', or a list of those)")
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    paths: list[Path] = []
    for item in items:
        s = os.path.expanduser(str(item))
        if globmod.has_magic(s):
            hits = sorted(globmod.glob(s), key=_natural_key)
            if not hits:
                raise UserError(f"input {item}: no file matches")
            paths.extend(Path(h) for h in hits)
        else:
            paths.append(Path(s))
    for p in paths:
        if not p.exists():
            raise UserError(f"input {p} does not exist")
        if p.is_dir():
            raise UserError(f"input {p} is a directory; give files (or a glob like {p}/day_*)")
        if p.stat().st_size == 0:
            raise UserError(f"input {p} is empty")
        if not os.access(p, os.R_OK):
            raise UserError(f"input {p} is not readable")
    return paths


@dataclass
class _Block:
    file_index: int
    block_index: int
    first_line: int  # 1-based line number of the block's first line in its file
    data: bytes | memoryview
    bytes_read: int  # input bytes consumed so far (all files, compressed bytes for gz)


def _pieces(path: Path, size: int) -> Iterator[tuple[bytes, int]]:
    """The file's bytes (decompressed if it is gzip: concatenated members
    allowed), in pieces of about `size`, with the input bytes consumed so far."""
    with open(path, "rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        if not gz:
            while piece := raw.read(size):
                yield piece, raw.tell()
            return
        d = zlib.decompressobj(wbits=31)
        out: list[bytes] = []
        have = 0
        comp = b""
        try:
            while True:
                if not comp:
                    comp = raw.read(1 << 20)
                    if not comp:
                        break
                if d.eof:  # more data after a complete member: the next member
                    d = zlib.decompressobj(wbits=31)
                piece = d.decompress(comp, size - have)
                comp = d.unused_data if d.eof else d.unconsumed_tail
                out.append(piece)
                have += len(piece)
                if have >= size:
                    yield b"".join(out), raw.tell() - len(comp)
                    out, have = [], 0
        except zlib.error as e:
            raise UserError(f"{path}: not valid gzip data ({e})") from None
        if not d.eof:
            raise UserError(f"{path}: truncated gzip file (unexpected end of data)")
        if out:
            yield b"".join(out), raw.tell()


def _iter_blocks(paths: Sequence[Path], block_size: int) -> Iterator[_Block]:
    """Blocks of whole lines (about block_size bytes) of every file in turn."""
    done = 0
    for fi, path in enumerate(paths):
        line = 1
        bi = 0
        pending = b""
        pos = 0
        for piece, pos in _pieces(path, block_size):
            data = pending + piece if pending else piece
            cut = data.rfind(b"\n") + 1
            pending = data[cut:]
            if cut:
                yield _Block(fi, bi, line, memoryview(data)[:cut], done + pos)
                line += data.count(b"\n", 0, cut)
                bi += 1
        if pending:  # a last line without a line end
            yield _Block(fi, bi, line, pending, done + pos)
        done += path.stat().st_size


# --------------------------------------------------------------------------- the passes


@dataclass
class _Chunk:
    decoded: _Decoded
    skipped: int
    bad_lines: list[int]  # indices of the dropped lines within the block
    block: _Block


class _Reader:
    """Blocks -> decoded, checked chunks; bad lines are located and either
    raised (on_error=raise) or dropped (on_error=skip)."""

    skip_hint = " (on_error=skip drops such lines)"

    def __init__(self, cfg: CriteoConfig, paths: Sequence[Path]):
        self.cfg = cfg
        self.paths = paths
        self.parser = _Parser(cfg)
        self.first_skipped: tuple[Path, int, bytes] | None = None  # on_error=skip: the first line dropped

    def no_valid_rows(self) -> UserError:
        message = f"no valid rows in {', '.join(map(str, self.paths))}"
        if self.first_skipped is not None:
            path, line, text = self.first_skipped
            message += f": every line was skipped as bad (the first, {path} line {line}: "
            message += f"{_diagnose(text, self.parser.label_int8)})"
        return UserError(message)

    def chunks(self, want_dense: bool, known_bad: dict | None = None) -> Iterator[_Chunk]:
        # reading (and gunzipping) runs on its own thread, ahead of parsing
        with BackgroundIterator(_iter_blocks(self.paths, self.cfg.block_size), depth=2, name="criteo-read") as blocks:
            for block in blocks:
                # Pass 2: drop the lines pass 1 found bad (by line number in the file).
                file_bad = known_bad.get(block.file_index) if known_bad else None
                if file_bad:
                    lines = _split_lines(bytes(block.data))
                    lo = bisect.bisect_left(file_bad, block.first_line)
                    hi = bisect.bisect_left(file_bad, block.first_line + len(lines))
                    if hi > lo:
                        bad = [ln - block.first_line for ln in file_bad[lo:hi]]
                        kept = _join_lines(lines, set(bad))
                        yield _Chunk(self._parse_clean(kept, want_dense), len(bad), bad, block)
                        continue
                try:
                    yield _Chunk(self.parser.parse(block.data, want_dense), 0, [], block)
                except _BadBlock:
                    yield self._slow(block, want_dense)

    def _parse_clean(self, data: bytes, want_dense: bool) -> _Decoded:
        try:
            return self.parser.parse(data, want_dense)
        except _BadBlock as e:  # pragma: no cover - the input changed between passes
            raise UserError(f"input changed while it was being preprocessed ({e})") from None

    def _line_ok(self, line: bytes) -> bool:
        try:
            self.parser.parse(line + b"\n", False)
            return True
        except _BadBlock:
            return False

    def _slow(self, block: _Block, want_dense: bool) -> _Chunk:
        """Find the bad lines of a block that failed the vectorised checks."""
        lines = _split_lines(bytes(block.data))
        bad: list[int] = []
        for i, raw in enumerate(lines):
            line = _strip_cr(raw)
            if not line:
                continue
            if self.parser.labels and _LINE_RE.fullmatch(line) and _label_ok(line, self.parser.label_int8):
                continue
            if not self.parser.labels and _UNLABELLED_LINE_RE.fullmatch(line):
                continue
            if self._line_ok(line):  # stricter than Arrow here: Arrow decides
                continue
            self._bad(block, i, line)
            bad.append(i)
        try:
            decoded = self.parser.parse(_join_lines(lines, set(bad)), want_dense)
        except _BadBlock:
            # Lines the regex passed but Arrow rejects: bisect with Arrow itself.
            bad_set = set(bad)
            more = self._bisect(block, lines, [i for i in range(len(lines)) if i not in bad_set])
            bad = sorted(bad_set | set(more))
            decoded = self._parse_clean(_join_lines(lines, set(bad)), want_dense)
        return _Chunk(decoded, len(bad), bad, block)

    def _bisect(self, block: _Block, lines: list[bytes], idx: list[int]) -> list[int]:
        if not idx:
            return []
        data = b"\n".join(lines[i] for i in idx) + b"\n"
        try:
            self.parser.parse(data, False)
            return []
        except _BadBlock:
            pass
        if len(idx) == 1:
            self._bad(block, idx[0], _strip_cr(lines[idx[0]]))
            return [idx[0]]
        mid = len(idx) // 2
        return self._bisect(block, lines, idx[:mid]) + self._bisect(block, lines, idx[mid:])

    def _bad(self, block: _Block, i: int, line: bytes) -> None:
        if self.cfg.on_error == "raise":
            path = self.paths[block.file_index]
            reason = _diagnose(line, self.parser.label_int8, self.parser.labels)
            where = f"{path} line {block.first_line + i}"
            if reason.startswith("column "):
                raise UserError(f"{where} {reason}{self.skip_hint}")
            if reason.endswith(UNLABELLED):  # skipping would skip every line
                raise UserError(f"{where}: {reason}")
            raise UserError(f"{where}: {reason}{self.skip_hint}")
        if self.first_skipped is None:
            self.first_skipped = (self.paths[block.file_index], block.first_line + i, line)


def _label_ok(line: bytes, int8: bool) -> bool:
    tab = line.find(b"\t")
    try:
        x = float(line[:tab] if tab >= 0 else line)
    except ValueError:
        return False
    return 0 <= x <= 1 and (not int8 or x in (0.0, 1.0))


def _join_lines(lines: list[bytes], drop: set[int]) -> bytes:
    kept = [ln for i, ln in enumerate(lines) if i not in drop]
    return b"\n".join(kept) + b"\n" if kept else b""


def decoded_blocks(paths: Sequence[Path], *, labels: bool = True, block_size: int = 8 << 20):
    """Parsed, checked blocks of raw rows in input order, for scoring
    (recsys predict): (_Decoded, input bytes read so far). A bad line is a
    UserError naming the file, line and column."""
    cfg = CriteoConfig(input=[str(p) for p in paths], labels=labels, block_size=block_size)
    reader = _Reader(cfg, paths)
    reader.skip_hint = ""  # every row must be scored: no skipping
    with BackgroundIterator(reader.chunks(want_dense=True), name="criteo-parse") as chunks:
        for ch in chunks:
            yield ch.decoded, ch.block.bytes_read


def count_fields(path: Path) -> int:
    """Tab-separated fields of the file's first non-empty line (40 labelled, 39 not)."""
    for piece, _ in _pieces(path, 1 << 16):
        for line in piece.split(b"\n"):
            line = _strip_cr(line)
            if line:
                return line.count(b"\t") + 1
        break
    return 0


# --------------------------------------------------------------------------- progress


class _Progress:
    def __init__(self, enabled: bool, total_bytes: int):
        self.p = None
        self.total = total_bytes
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        console = Console(stderr=True)
        if not console.is_terminal:
            return
        self.p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[rows]:>12,} rows  {task.fields[rate]:>9,.0f} rows/s"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )

    def __enter__(self):
        if self.p is not None:
            self.p.start()
        return self

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.stop()
        return False

    def task(self, name: str):
        t0 = time.perf_counter()
        if self.p is None:
            return lambda rows, nbytes: None
        tid = self.p.add_task(name, total=self.total, rows=0, rate=0.0)

        def update(rows: int, nbytes: int) -> None:
            dt = max(time.perf_counter() - t0, 1e-9)
            self.p.update(tid, completed=nbytes, rows=rows, rate=rows / dt)

        return update


# --------------------------------------------------------------------------- main entry


def _validate(cfg: CriteoConfig) -> None:
    if cfg.output in (None, ""):
        raise UserError("output=DIR is required")
    if cfg.label_dtype not in ("float32", "int8"):
        raise UserError(f"label_dtype must be float32 or int8, got {cfg.label_dtype!r}")
    if cfg.split not in ("kaggle", "ratios", "none"):
        raise UserError(f"split must be kaggle, ratios or none, got {cfg.split!r}")
    if cfg.split == "ratios":
        sh.ratio_ranges(1, cfg.ratios)
    if cfg.on_error not in ("raise", "skip"):
        raise UserError(f"on_error must be raise or skip, got {cfg.on_error!r}")
    if cfg.min_count < 1:
        raise UserError(f"min_count must be >= 1, got {cfg.min_count}")
    if cfg.hash_buckets is not None:
        if cfg.hash_buckets < 2:
            raise UserError(f"hash_buckets must be >= 2 (id 0 is for missing values), got {cfg.hash_buckets}")
        if cfg.hash_buckets > 2**31:
            raise UserError(f"hash_buckets must be <= 2**31 (ids are int32), got {cfg.hash_buckets}")
        if cfg.min_count != 1:
            raise UserError("min_count and hash_buckets exclude each other: hashing keeps every value")
    if cfg.vocab is not None and (cfg.hash_buckets is not None or cfg.min_count != 1):
        raise UserError("vocab=DIR maps values with DIR's vocabulary: min_count and hash_buckets do not apply")
    if not cfg.labels and cfg.vocab is None and cfg.hash_buckets is None:
        raise UserError("labels=false needs vocab=DIR (the training data's vocabulary) or hash_buckets=N")
    if cfg.row_group_rows < 1 or cfg.shard_rows < 1:
        raise UserError("row_group_rows and shard_rows must be >= 1")
    if cfg.block_size < 1024:
        raise UserError(f"block_size must be >= 1024 bytes, got {cfg.block_size}")


def _ranges(cfg: CriteoConfig, total: int) -> list[tuple[str, int, int]]:
    if cfg.split == "none":
        return [(ALL_SPLIT, 0, total)]
    return sh.kaggle_ranges(total) if cfg.split == "kaggle" else sh.ratio_ranges(total, cfg.ratios)


def _ids_table(schema: pa.Schema, d: _Decoded, ids: list[np.ndarray], label_type) -> pa.Table:
    cols = [] if d.label is None else [pa.array(d.label.astype(label_type, copy=False))]
    cols.append(sh.dense_array(d.dense))
    for f in range(NUM_SPARSE):
        cols.append(pa.array(ids[f]))
    return pa.Table.from_arrays(cols, schema=schema)


def _scatter(present: np.ndarray, mapped: np.ndarray) -> np.ndarray:
    out = np.zeros(len(present), dtype=np.int32)
    out[present] = mapped
    return out


def _vocabulary_mode(cfg: CriteoConfig, reader: "_Reader", paths, tmp: Path, progress, timings, t0):
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


def _spill_batch(d: _Decoded, cols: list[np.ndarray], label_type) -> pa.RecordBatch:
    arrays = [pa.array(d.label.astype(label_type, copy=False)), sh.dense_array(d.dense)]
    arrays += [pa.array(c) for c in cols]
    return pa.RecordBatch.from_arrays(arrays, names=["label", "dense", *CRITEO_SPARSE])


def preprocess(cfg: CriteoConfig, *, console=None) -> Manifest:
    """Run the preprocessing described by `cfg`; returns the manifest written."""
    from rich.console import Console

    if isinstance(cfg.input, tuple):
        cfg = dataclasses.replace(cfg, input=list(cfg.input))
    _validate(cfg)
    console = console or Console(stderr=True, highlight=False)
    paths = resolve_inputs(cfg.input)
    output = Path(cfg.output).expanduser()
    for p in paths:  # it would be read while its directory is replaced
        if output.resolve() in p.resolve().parents:
            raise UserError(f"input {p} is inside the output directory {output}; write the dataset elsewhere")
    sh.check_output(output.absolute())
    source_vocab = _source_vocabulary(cfg)
    total_bytes = sum(p.stat().st_size for p in paths)
    t0 = time.perf_counter()
    reader = _Reader(cfg, paths)
    timings: dict[str, float] = {}
    unknown: dict[str, int] | None = None
    with _Progress(cfg.progress, total_bytes) as progress, sh.atomic_dataset_dir(output) as tmp:
        distinct: dict[str, int] | None = None
        if source_vocab is None and cfg.hash_buckets is None:
            features, splits, skipped, distinct, vocab_entry = _vocabulary_mode(
                cfg, reader, paths, tmp, progress, timings, t0)
        else:
            if source_vocab is not None:
                vocabulary, features = source_vocab
                vocab_entry = {**vocab_io.copy_vocabulary(Path(cfg.vocab).expanduser(), tmp),
                               "source": str(Path(cfg.vocab).expanduser().absolute())}
            else:
                features = [SparseFeature(n, int(cfg.hash_buckets)) for n in CRITEO_SPARSE]
                vocabulary = vocab_io.Vocabulary(CRITEO_SPARSE, "hash", hash_buckets=int(cfg.hash_buckets))
                vocab_entry = {"mode": "hash", "hash_buckets": int(cfg.hash_buckets), "features": CRITEO_SPARSE,
                               "fingerprint": vocab_io.hash_fingerprint(CRITEO_SPARSE, int(cfg.hash_buckets))}
            splits, skipped, unseen = _mapped_mode(cfg, reader, paths, tmp, progress, vocabulary, features)
            if source_vocab is not None:
                unknown = dict(zip(CRITEO_SPARSE, map(int, unseen)))
        seconds = time.perf_counter() - t0
        if "pass 1" in timings:
            timings["pass 2"] = seconds - timings["pass 1"]
        options = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("progress",)}
        options["input"] = [str(p) for p in paths]
        options["mode"] = "hash" if vocab_entry["mode"] == "hash" else "vocabulary"
        options["vocabulary"] = vocab_entry
        if distinct is not None:
            options["distinct_values"] = distinct
        if unknown is not None:
            # present values the vocabulary has no id for (unseen in training, or rarer than its min_count)
            options["unknown_values"] = unknown
        manifest = Manifest(
            source="criteo",
            sparse_features=features,
            splits=splits,
            options=options,
            inputs=[{"path": str(p), "bytes": p.stat().st_size} for p in paths],
            skipped_lines=int(skipped),
            labelled=cfg.labels,
        )
        manifest.save(tmp)
    _summary(console, manifest, output, seconds, timings)
    return manifest


def _source_vocabulary(cfg: CriteoConfig):
    """vocab=DIR: (the vocabulary, DIR's sparse features), checked; else None."""
    if cfg.vocab is None:
        return None
    from data_tools.manifest import ManifestError, load_manifest

    source = Path(cfg.vocab).expanduser()
    try:
        vocabulary = vocab_io.load_vocabulary(source)
        features = load_manifest(source).sparse_features
    except ManifestError as e:
        raise UserError(f"vocab={cfg.vocab}: {e}") from None
    if vocabulary.features != CRITEO_SPARSE:
        raise UserError(f"vocab={cfg.vocab}: its features {vocabulary.features} are not Criteo's C1..C26")
    return vocabulary, features


def _mapped_mode(cfg: CriteoConfig, reader: "_Reader", paths, tmp: Path, progress, vocabulary, features):
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
    names = (ALL_SPLIT,) if cfg.split == "none" else SPLITS
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


def _summary(console, m: Manifest, output: Path, seconds: float, timings: dict[str, float]) -> None:
    total = sum(s.rows for s in m.splits.values())
    rate = total / max(seconds, 1e-9)
    splits = ", ".join(f"{k} {v.rows:,}" for k, v in m.splits.items())
    vocab = " ".join(f"{f.name}={f.vocab_size:,}" for f in m.sparse_features)
    console.print(
        f"[bold]criteo[/]: {total:,} rows ({splits}) in {seconds:.1f} s, {rate:,.0f} rows/s"
        + (f", {m.skipped_lines:,} bad lines skipped" if m.skipped_lines else "")
        + (" (" + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()) + ")" if timings else "")
    )
    console.print(f"vocabulary: {vocab}")
    entry = m.options.get("vocabulary", {})
    if entry.get("mode") == "vocabulary":
        where = f"copied from {entry['source']}" if "source" in entry else f"{vocab_io.VOCAB_DIR}/"
        console.print(f"saved vocabulary: {sum(e['size'] for e in entry['files'].values()):,} values, "
                      f"{entry['bytes'] / 2**20:,.1f} MiB ({where})")
    unknown = m.options.get("unknown_values")
    if unknown:
        console.print(f"values without an id (-> 0): {sum(unknown.values()):,} "
                      f"(most in {max(unknown, key=unknown.get)}: {max(unknown.values()):,})")
    console.print(f"wrote {output}")
