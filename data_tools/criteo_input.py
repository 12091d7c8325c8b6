"""Raw Criteo input: files -> blocks of whole lines -> checked, decoded blocks.

Files are read in order as one sequence of rows, plain or gzip (detected
from the first bytes; concatenated members allowed), in blocks of about
`block_size` bytes cut at line ends, on a background thread ahead of parsing.
BlockReader parses each block (criteo_text.BlockParser); a block that fails
the vectorised checks is re-scanned line by line, and each bad line is either
a UserError naming the file, the 1-based line and the column (on_error=raise)
or dropped and counted (on_error=skip). `decoded_blocks` is the same reading
for scoring (recsys predict), where every row must be scored.
"""

from __future__ import annotations

import bisect
import glob as globmod
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_tools.background import BackgroundIterator
from data_tools.criteo_text import (
    UNLABELLED,
    UNLABELLED_SCORED,
    LINE_RE,
    UNLABELLED_LINE_RE,
    BadBlock,
    BlockParser,
    DecodedBlock,
    diagnose_line,
    join_lines,
    label_ok,
    split_lines,
    strip_cr,
)
from data_tools.errors import UserError



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
class TextBlock:
    file_index: int
    block_index: int
    first_line: int  # 1-based line number of the block's first line in its file
    data: bytes | memoryview
    bytes_read: int  # input bytes consumed so far (all files, compressed bytes for gz)
    lines: int  # lines in data: its line ends, or 1 for a last line without one


# The first bytes of compressed files that are not gzip
OTHER_COMPRESSION = ((b"\xfd7zXZ\x00", "xz-compressed"), (b"BZh", "bzip2-compressed"),
                     (b"\x28\xb5\x2f\xfd", "zstd-compressed"), (b"PK\x03\x04", "a zip archive"))


BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark, which editors on Windows put at the start of a file


def file_pieces(path: Path, size: int) -> Iterator[tuple[bytes, int]]:
    """The file's bytes (decompressed if it is gzip: concatenated members
    allowed), in pieces of about `size`, with the input bytes consumed so far;
    a byte order mark that starts the file is dropped (anywhere else it is
    part of a line, and a bad line: criteo_text._check_bytes)."""
    first = True
    for piece, pos in _file_pieces(path, size):
        if first and piece.startswith(BOM):
            piece = piece[len(BOM):]
        first = False
        yield piece, pos


def _file_pieces(path: Path, size: int) -> Iterator[tuple[bytes, int]]:
    with open(path, "rb") as raw:
        head = raw.read(6)
        gz = head[:2] == b"\x1f\x8b"
        other = next((name for magic, name in OTHER_COMPRESSION if head.startswith(magic)), None)
        if other:  # read as text, it was "line 1: expected 40 tab-separated fields, found 2"
            raise UserError(f"{path} is {other}: recsys reads plain or gzip'd Criteo TSV (decompress it, or "
                            "recompress it with gzip)")
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


def text_blocks(paths: Sequence[Path], block_size: int) -> Iterator[TextBlock]:
    """Blocks of whole lines (about block_size bytes) of every file in turn."""
    done = 0
    for fi, path in enumerate(paths):
        line = 1
        bi = 0
        pending = b""
        pos = 0
        for piece, pos in file_pieces(path, block_size):
            data = pending + piece if pending else piece
            cut = data.rfind(b"\n") + 1
            pending = data[cut:]
            if cut:
                lines = data.count(b"\n", 0, cut)
                yield TextBlock(fi, bi, line, memoryview(data)[:cut], done + pos, lines)
                line += lines
                bi += 1
        if pending:  # a last line without a line end
            yield TextBlock(fi, bi, line, pending, done + pos, 1)
        done += path.stat().st_size



@dataclass
class CheckedBlock:
    decoded: DecodedBlock
    skipped: int
    bad_lines: list[int]  # indices of the dropped lines within the block
    block: TextBlock


class BlockReader:
    """Blocks -> decoded, checked chunks; bad lines are located and either
    raised (on_error=raise) or dropped (on_error=skip)."""

    skip_hint = " (on_error=skip drops such lines)"
    unlabelled_hint = UNLABELLED  # what a 39-field line among labelled ones is told (diagnose_line)

    def __init__(self, paths: Sequence[Path], *, labels: bool = True, label_int8: bool = False,
                 block_size: int = 8 << 20, on_error: str = "raise"):
        self.paths = paths
        self.block_size = block_size
        self.on_error = on_error  # raise | skip
        self.parser = BlockParser(labels=labels, label_int8=label_int8, block_size=block_size)
        self.first_skipped: tuple[Path, int, bytes] | None = None  # on_error=skip: the first line dropped

    def no_valid_rows(self) -> UserError:
        message = f"no valid rows in {', '.join(map(str, self.paths))}"
        if self.first_skipped is not None:
            path, line, text = self.first_skipped
            message += f": every line was skipped as bad (the first, {path} line {line}: "
            message += f"{diagnose_line(text, self.parser.label_int8)})"
        return UserError(message)

    def chunks(self, want_dense: bool, known_bad: dict | None = None) -> Iterator[CheckedBlock]:
        # reading (and gunzipping) runs on its own thread, ahead of parsing
        with BackgroundIterator(text_blocks(self.paths, self.block_size), depth=2, name="criteo-read") as blocks:
            for block in blocks:
                yield self.check(block, want_dense, known_bad)

    def check(self, block: TextBlock, want_dense: bool, known_bad: dict | None = None) -> CheckedBlock:
        """One block parsed and checked; its bad lines raised or dropped."""
        # Pass 2: drop the lines pass 1 found bad (by line number in the file).
        file_bad = known_bad.get(block.file_index) if known_bad else None
        if file_bad:
            lines = split_lines(bytes(block.data))
            lo = bisect.bisect_left(file_bad, block.first_line)
            hi = bisect.bisect_left(file_bad, block.first_line + len(lines))
            if hi > lo:
                bad = [ln - block.first_line for ln in file_bad[lo:hi]]
                kept = join_lines(lines, set(bad))
                return CheckedBlock(self._parse_clean(kept, want_dense), len(bad), bad, block)
        try:
            return CheckedBlock(self.parser.parse(block.data, want_dense, block.lines), 0, [], block)
        except BadBlock:
            return self._slow(block, want_dense)

    def _parse_clean(self, data: bytes, want_dense: bool) -> DecodedBlock:
        try:
            return self.parser.parse(data, want_dense)
        except BadBlock as e:  # pragma: no cover - the input changed between passes
            raise UserError(f"input changed while it was being preprocessed ({e})") from None

    def _line_ok(self, line: bytes) -> bool:
        try:
            self.parser.parse(line + b"\n", False, 1)
            return True
        except BadBlock:
            return False

    def _slow(self, block: TextBlock, want_dense: bool) -> CheckedBlock:
        """Find the bad lines of a block that failed the vectorised checks."""
        lines = split_lines(bytes(block.data))
        bad: list[int] = []
        for i, raw in enumerate(lines):
            line = strip_cr(raw)  # an empty line is bad: it falls through to _bad
            if self.parser.labels and LINE_RE.fullmatch(line) and label_ok(line, self.parser.label_int8):
                continue
            if not self.parser.labels and UNLABELLED_LINE_RE.fullmatch(line):
                continue
            if self._line_ok(raw):  # stricter than Arrow here: Arrow decides (on the line with its own CR)
                continue
            if self.on_error == "raise" and not bad:
                # An earlier line the pattern passed may be one Arrow refuses (I1 = 2**63): the first bad
                # line is the one to name. _bisect raises on the first it finds, left to right.
                self._bisect(block, lines, list(range(i)))
            self._bad(block, i, line)
            bad.append(i)
        try:
            decoded = self.parser.parse(join_lines(lines, set(bad)), want_dense)
        except BadBlock:
            # Lines the regex passed but Arrow rejects: bisect with Arrow itself.
            bad_set = set(bad)
            more = self._bisect(block, lines, [i for i in range(len(lines)) if i not in bad_set])
            bad = sorted(bad_set | set(more))
            decoded = self._parse_clean(join_lines(lines, set(bad)), want_dense)
        return CheckedBlock(decoded, len(bad), bad, block)

    def _bisect(self, block: TextBlock, lines: list[bytes], idx: list[int]) -> list[int]:
        if not idx:
            return []
        data = b"\n".join(lines[i] for i in idx) + b"\n"
        try:
            self.parser.parse(data, False)
            return []
        except BadBlock:
            pass
        if len(idx) == 1:
            self._bad(block, idx[0], strip_cr(lines[idx[0]]))
            return [idx[0]]
        mid = len(idx) // 2
        return self._bisect(block, lines, idx[:mid]) + self._bisect(block, lines, idx[mid:])

    def _bad(self, block: TextBlock, i: int, line: bytes) -> None:
        if self.on_error == "raise":
            path = self.paths[block.file_index]
            reason = diagnose_line(line, self.parser.label_int8, self.parser.labels, self.unlabelled_hint)
            where = f"{path} line {block.first_line + i}"
            if reason.startswith("column "):
                raise UserError(f"{where} {reason}{self.skip_hint}")
            if reason.endswith(self.unlabelled_hint):  # skipping would skip every line
                raise UserError(f"{where}: {reason}")
            raise UserError(f"{where}: {reason}{self.skip_hint}")
        if self.first_skipped is None:
            self.first_skipped = (self.paths[block.file_index], block.first_line + i, line)


def decoded_blocks(paths: Sequence[Path], *, labels: bool = True, block_size: int = 8 << 20):
    """Parsed, checked blocks of raw rows in input order, for scoring
    (recsys predict): (DecodedBlock, input bytes read so far). A bad line is a
    UserError naming the file, line and column."""
    reader = BlockReader(paths, labels=labels, block_size=block_size)
    reader.skip_hint = ""  # every row must be scored: no skipping
    reader.unlabelled_hint = UNLABELLED_SCORED
    with BackgroundIterator(reader.chunks(want_dense=True), name="criteo-parse") as chunks:
        for ch in chunks:
            yield ch.decoded, ch.block.bytes_read


def count_fields(path: Path) -> tuple[int, int]:
    """(1-based line number, tab-separated fields) of the file's first
    non-empty line (40 labelled, 39 not); (0, 0) if the first 64 KiB have none."""
    for piece, _ in file_pieces(path, 1 << 16):
        for number, line in enumerate(piece.split(b"\n"), 1):
            line = strip_cr(line)
            if line:
                return number, line.count(b"\t") + 1
        break
    return 0, 0


def labelled(path: Path) -> bool:
    """Whether raw input is labelled, from its first non-empty line: 40
    fields (True) or 39 (False); else a UserError naming that line."""
    number, fields = count_fields(path)
    if not number:
        raise UserError(f"{path}: no non-empty line in its first 64 KiB (expected 40 tab-separated fields, "
                        "39 without the label)")
    if fields not in (39, 40):
        raise UserError(f"{path} line {number}: expected 40 tab-separated fields (39 without the label), "
                        f"found {fields}")
    return fields == 40
