"""A checkpoint's files: their names, the reference a sharded one holds, the shard manifest.

A checkpoint directory holds, per saved step:

  step-NNNNNNNN.pt          the state (plain data: safe_load.plain), renamed into place whole
  step-NNNNNNNN.files.json  its record: every file it consists of, with size and XXH3-64 (record.py)
  step-NNNNNNNN.shards/     a sharded run's tables (shard_write.py), which the .pt's "tables" names
  latest.json               the newest checkpoint ({"file", "step"})
  best.json                 the checkpoint of the best validation so far (trainer.keep_best)

and beside them a disk table's base and delta files (embeddings/disk_checkpoint.py).

A shard directory holds:

  __R_0.distcp    rank R's shards, written by rank R (DCP's FileSystemWriter)
  .metadata       DCP's index of every key (rank 0 writes it)
  caches-R.pt     rank R's cache snapshot, for a resume on the same world size
  shards.json     the manifest: the pieces (table, saving rank, rows [lo, hi),
                  precision, fields), each table's rows, the saving world size
                  and every file's size and XXH3-64 (checksum.py)

A piece is one rank's rows [lo, hi) of one table, in the entry format of
RowStore.table_snapshot: "precision", the precision's row tensors, "state",
and optionally a "patch" of rows a cache holds dirty (ids local to the
piece). Its DCP keys are "<table>/rows-<lo>-<hi>/<field>" and
"<table>/rows-<lo>-<hi>/patch/<field>" (shard_key): the table and the
global row range, so a reader finds the rows whatever world size saved
them. A shard on disk is saved as pieces of its records
("<table>/rows-<lo>-<hi>/records").

The manifest is one line of JSON and a line with its own checksum: it is
checked before anything it says is trusted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeGuard

import xxhash

from recsys_cli.checksum import ALGORITHM, Checksum, DamagedFile
from recsys_cli.errors import UserError

LATEST = "latest.json"

BEST = "best.json"  # trainer.keep_best: the checkpoint of the best validation so far


def step_file(step: int) -> str:
    return f"step-{step:08d}.pt"


SUFFIX = ".shards"

MANIFEST = "shards.json"

SHARD_FORMAT = 1

METADATA = ".metadata"  # DCP's index file

RECORDS = "records"  # a disk shard's field: its rows' records (disk_records.py)


def shard_dir(checkpoint_dir: Path | str, step: int) -> Path:
    """Where the shards of the checkpoint of `step` live: step-NNNNNNNN.shards beside step-NNNNNNNN.pt."""
    return Path(checkpoint_dir) / f"step-{step:08d}{SUFFIX}"


def shard_dir_of(checkpoint: Path | str) -> Path:
    """The shard directory named after a checkpoint file (step-NNNNNNNN.pt -> step-NNNNNNNN.shards)."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(checkpoint.name[: -len(".pt")] + SUFFIX)


def tables_reference(directory: Path | str, plan: dict) -> dict:
    """What a sharded checkpoint's .pt holds as its "tables": the shard
    directory's name (relative to the .pt) and the plan (ShardPlan.to_dict())."""
    return {"sharded": Path(directory).name, "plan": plan}


def is_sharded(tables: Any) -> TypeGuard[dict]:
    """Whether a checkpoint's "tables" value is a reference to a shard directory."""
    return isinstance(tables, dict) and isinstance(tables.get("sharded"), str)


def shard_key(table: str, lo: int, hi: int, field: str, patch: bool = False) -> str:
    return f"{table}/rows-{lo}-{hi}/{'patch/' if patch else ''}{field}"


def hash_file(path: Path) -> dict:
    got = Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            got.update(chunk)
    return got.record()


def write_manifest(path: Path, body: dict) -> None:
    """One line of JSON, then a line with its own XXH3-64: the manifest is
    checked before anything it says is trusted."""
    text = json.dumps(body, sort_keys=True)
    with open(path, "w") as f:
        f.write(f"{text}\n{ALGORITHM} {xxhash.xxh3_64_hexdigest(text.encode())}\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise DamagedFile(path, "missing") from None
    except OSError as e:
        raise DamagedFile(path, f"unreadable ({e.strerror or e})") from None
    body, _, tail = text.partition(b"\n")
    algorithm, _, digest = tail.decode(errors="replace").strip().partition(" ")
    got = xxhash.xxh3_64_hexdigest(body)
    if algorithm != ALGORITHM or got != digest:
        said = tail.decode(errors="replace").strip()
        raise DamagedFile(path, f"its {ALGORITHM} is {got}, its last line says {said!r}")
    manifest = json.loads(body)
    if manifest.get("format") != SHARD_FORMAT:
        raise UserError(f"{path}: shard format {manifest.get('format')!r}, this recsys reads {SHARD_FORMAT}")
    return manifest


def recorded_files(directory: Path | str) -> dict[str, dict]:
    """Every file of a complete shard directory with its size and checksum
    (names relative to it), the manifest included: what the checkpoint's
    record lists (write.save_checkpoint)."""
    directory = Path(directory)
    files = dict(read_manifest(directory)["files"])
    files[MANIFEST] = hash_file(directory / MANIFEST)
    return files
