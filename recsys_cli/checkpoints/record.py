"""A checkpoint's record: the files it consists of, each with its size and checksum.

step-NNNNNNNN.files.json beside step-NNNNNNNN.pt names the .pt itself and
every disk-table file (base, deltas) its tables need, with the size and
XXH3-64 (checksum.py) computed while each was written. It is renamed into
place before the .pt is, so a checkpoint in place always has its record.
Every reader of a checkpoint checks the .pt against it (verify.py), the
disk files as it reads them (disk_checkpoint.py), and `recsys verify`
checks every file of every checkpoint of a run (verify.checkpoint_problems).

A record written before checksums (a JSON list of disk-file names) still
names the files a checkpoint keeps, with nothing to check them against.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from recsys_cli.checksum import ALGORITHM, OLDER

FORMAT = 2


def record_path(checkpoint: Path) -> Path:
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(checkpoint.name[: -len(".pt")] + ".files.json")


def write_record(checkpoint: Path, files: dict[str, dict]) -> Path:
    """Write the record of `checkpoint`: file name (relative to its directory) -> {bytes, xxh3_64}."""
    path = record_path(checkpoint)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps({"format": FORMAT, "files": dict(sorted(files.items()))}))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_record(checkpoint: Path) -> dict[str, dict | None] | None:
    """name -> {bytes, xxh3_64 (crc32 in older records)} (None for a file an old record names without a
    checksum); None when the checkpoint has no readable record (missing, or not a record's JSON: an
    entry without an integer size and a hex digest made the reader fail with a traceback)."""
    try:
        data = json.loads(record_path(checkpoint).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if isinstance(data, list):  # before checksums: disk-file names only
        return {str(name): None for name in data}
    if isinstance(data, dict) and isinstance(data.get("files"), dict) and all(
            isinstance(name, str) and _is_entry(entry) for name, entry in data["files"].items()):
        return data["files"]
    return None


def _is_entry(entry: object) -> bool:
    """Whether a record's entry is a file's {"bytes": size, ALGORITHM (or an older one): hex digest}."""
    if not isinstance(entry, dict) or type(entry.get("bytes")) is not int or entry["bytes"] < 0:
        return False
    digests = [entry[a] for a in (ALGORITHM, *OLDER) if a in entry]
    return bool(digests) and all(isinstance(d, str) for d in digests)
