"""Checksums of the files a checkpoint consists of, computed while they are written.

Each file is hashed as its bytes pass to the disk (HashingWriter, or
Checksum.update on the chunks a writer produces), never by reading back
what was just written; a reader checks size and checksum against the
record (checked_reads, file_problem) and a mismatch is DamagedFile: one
line naming the file.

The checksum is XXH3-64 (the `xxhash` package, with the file's size): it
guards against damage (flipped bits, a truncated or overwritten file), not
against someone forging a file. It is the fastest well-kept hash at hand:
on this project's machine 13,000-15,600 MiB/s against zlib's CRC-32 at
2,200, SHA-256 at 1,300-1,600 and BLAKE2b at 1,000 (BENCHMARKS.md,
"Checkpoint checksums"),
so hashing in line with the write adds a few per cent to it where CRC-32
added a quarter of a .pt write and two thirds of a disk base's. A random
change escapes it with probability 2^-64. Records written before it name
`crc32` and are still checked with zlib's CRC-32.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import xxhash

from recsys_cli.errors import UserError

ALGORITHM = "xxh3_64"  # what new records hold; OLDER are still read
OLDER = ("crc32",)
READ_BYTES = 16 << 20  # a verifying read's chunk: bounded memory whatever the file's size


class DamagedFile(UserError):
    """A checkpoint file whose size or checksum is not the recorded one."""

    def __init__(self, path, problem: str) -> None:
        super().__init__(f"checkpoint file {path} is damaged: {problem}")
        self.path, self.problem = Path(path), problem


class Checksum:
    """A running hash and byte count of the bytes given to update(): XXH3-64
    for what is written, or the algorithm an older record names."""

    __slots__ = ("algorithm", "_xxh", "_crc", "nbytes")

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        self.algorithm, self.nbytes = algorithm, 0
        self._xxh = xxhash.xxh3_64() if algorithm == ALGORITHM else None
        self._crc = 0

    @classmethod
    def checking(cls, expected: dict | None) -> "Checksum":
        """The checksum that checks a file against its record (the record's algorithm)."""
        return cls(next((a for a in OLDER if expected and a in expected), ALGORITHM))

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        if self._xxh is not None:
            self._xxh.update(view)
        else:
            self._crc = zlib.crc32(view, self._crc)
        self.nbytes += view.nbytes

    def hexdigest(self) -> str:
        return self._xxh.hexdigest() if self._xxh is not None else f"{self._crc:08x}"

    def record(self) -> dict:
        """What a checkpoint's record keeps of the file."""
        return {"bytes": self.nbytes, self.algorithm: self.hexdigest()}


class HashingWriter:
    """A binary file object that checksums every byte written through it
    (torch.save writes through it: its zip writer streams each record once).
    `error` keeps the OSError a write raised (a full disk): torch's writer may
    lose it, raising only "unexpected pos" when it next writes (issue 40
    problem 5), and the caller still needs to know the disk was full."""

    def __init__(self, f) -> None:
        self.f, self.checksum = f, Checksum()
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.checksum.update(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()


def _mismatch(expected: dict, got: Checksum) -> str | None:
    if got.nbytes != expected["bytes"]:
        return f"{got.nbytes:,} bytes, its checkpoint's record says {expected['bytes']:,}"
    if got.hexdigest() != expected[got.algorithm]:
        return f"its {got.algorithm} is {got.hexdigest()}, its checkpoint's record says {expected[got.algorithm]}"
    return None


def check_size(path, f, expected: dict) -> None:
    """DamagedFile unless the open file `f` has the recorded size (before reading it)."""
    size = os.fstat(f.fileno()).st_size
    if size != expected["bytes"]:
        raise DamagedFile(path, f"{size:,} bytes, its checkpoint's record says {expected['bytes']:,}")


def file_problem(path, expected: dict) -> str | None:
    """Why the file at `path` is not the recorded one (missing, size, checksum), or None."""
    got = Checksum.checking(expected)
    try:
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != expected["bytes"]:
                return f"{os.fstat(f.fileno()).st_size:,} bytes, its checkpoint's record says {expected['bytes']:,}"
            buf = bytearray(READ_BYTES)
            while n := f.readinto(buf):
                got.update(memoryview(buf)[:n])
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return _mismatch(expected, got)


def check_file(path, expected: dict) -> None:
    problem = file_problem(path, expected)
    if problem is not None:
        raise DamagedFile(path, problem)


def check_end(path, expected: dict, got: Checksum) -> None:
    """After a reader read the whole file through `got`: DamagedFile on a mismatch."""
    problem = _mismatch(expected, got)
    if problem is not None:
        raise DamagedFile(path, problem)
