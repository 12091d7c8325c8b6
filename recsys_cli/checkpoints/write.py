"""Saving checkpoints: everything a resumed run needs to end where an uninterrupted one would.

A checkpoint is one file, step-NNNNNNNN.pt, written to a temporary name and
renamed; latest.json (also renamed into place) names the newest. A run
killed at any moment leaves the previous checkpoint intact; a write that
fails (a full disk) removes its temporary file and names the space it
needed. Tables on disk write their own files first (a base and deltas of
changed rows, see embeddings/disk_checkpoint.py).

Every file a checkpoint consists of is checksummed while it is written
(the .pt through HashingWriter: no second read), and its record,
step-NNNNNNNN.files.json (record.py), is renamed into place before the .pt.
The .pt holds plain data only (safe_load.plain).

A sharded run's tables (issue 29) are not in the .pt: its "tables" is a
reference, {"sharded": "step-NNNNNNNN.shards", "plan": ...}, to the
directory beside it that every rank wrote its shards into (shard_write.py).
The record lists that directory's files too, and pruning removes it with
its .pt.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import IO, cast

import torch

from recsys_cli import safe_load
from recsys_cli.checkpoints.layout import BEST, LATEST, is_sharded, recorded_files, shard_dir_of, step_file
from recsys_cli.checkpoints.read import best_file, newest_checkpoint
from recsys_cli.checkpoints.record import read_record, record_path, write_record
from recsys_cli.checkpoints.shard_write import remove_unreferenced
from recsys_cli.checksum import HashingWriter
from recsys_cli.embeddings.disk_checkpoint import DiskTableSnapshot, collect_garbage
from recsys_cli.errors import write_error


def save_checkpoint(directory: Path, step: int, state: dict, keep: int = 2) -> Path:
    path = directory / step_file(step)
    tmp = directory / f".{path.name}.tmp"
    latest_tmp = directory / f".{LATEST}.tmp"
    writing = path
    disk_tables: list[DiskTableSnapshot] = []
    out: HashingWriter | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        state, disk_tables, files = _save_disk_tables(directory, step, state)
        files.update(_shard_files(directory, state))
        # Through a file object: torch's writer then calls its write, and a
        # failed write's OSError (ENOSPC) is kept as the context of the
        # RuntimeError torch raises (given a path, torch says only
        # "basic_ios::clear: iostream error"). The writer checksums each
        # record of the zip as torch streams it out.
        with open(tmp, "wb") as f:
            out = HashingWriter(f)
            # plain data only (config enums as their strings): what load_checkpoint reads with weights_only
            torch.save(safe_load.plain(state), cast(IO[bytes], out))  # a file object in all but name
            f.flush()
            os.fsync(f.fileno())
        writing = record_path(path)
        write_record(path, {**files, path.name: out.checksum.record()})  # before the .pt: a .pt in place has one
        writing = path
        os.replace(tmp, path)
        writing = directory / LATEST
        latest_tmp.write_text(json.dumps({"file": path.name, "step": step}))
        os.replace(latest_tmp, directory / LATEST)
    except BaseException as e:  # the previous checkpoint and latest.json stay as they were
        written = tmp.stat().st_size if tmp.is_file() else 0
        tmp.unlink(missing_ok=True)
        latest_tmp.unlink(missing_ok=True)
        if not path.exists():  # a record written for a .pt that never came, and its shards
            record_path(path).unlink(missing_ok=True)
            shutil.rmtree(shard_dir_of(path), ignore_errors=True)
        failed = _os_error(e) or (out.error if out is not None else None)  # torch may have lost the OSError
        if failed is None:
            raise
        raise write_error(writing, failed, space_note(directory, written)) from None
    for table in disk_tables:  # the checkpoint is in place: disk chains continue from it
        table.committed()
    prune(directory, keep)
    return path


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints and the one best.json names
    (each with its shard directory, if sharded)."""
    best = best_file(directory)
    for old in sorted(directory.glob("step-*.pt"))[:-keep]:
        if old.name != best:
            old.unlink(missing_ok=True)
    remove_unreferenced(directory)  # after the .pt: a crash in between leaves no .pt without its shards
    referenced: set[str] = set()  # the disk files the remaining checkpoints consist of
    for ckpt in directory.glob("step-*.pt"):
        referenced.update(read_record(ckpt) or {})
    for record in directory.glob("step-*.files.json"):  # of a checkpoint pruned, or of a save killed before its rename
        if not record.with_name(record.name[: -len(".files.json")] + ".pt").exists():
            record.unlink(missing_ok=True)
    if (directory / "disk").is_dir():
        collect_garbage(directory, referenced)


def mark_best(directory: Path, step: int, metric: str, mode: str, value: float, keep: int) -> None:
    """best.json names the checkpoint of `step` (written to a temporary name
    and renamed); the previous best goes unless it is among the newest `keep`."""
    tmp = directory / f".{BEST}.tmp"
    try:
        tmp.write_text(json.dumps({"file": step_file(step), "step": step, "metric": metric, "mode": mode,
                                   "value": value}))
        os.replace(tmp, directory / BEST)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(directory / BEST, e) from None
    prune(directory, keep)


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind a failed write: `e` itself, or the one torch's
    writer raised inside (a RuntimeError whose context it is); None for any
    other failure (a bug: re-raised as it is)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def space_note(directory: Path, written: int = 0, freed: int = 0) -> str:
    """What a failed checkpoint write's error adds: the space a checkpoint
    needs, the space free (with `freed` bytes of the failed save's files,
    about to be removed), and the checkpoint kept (for the one-process save
    and every rank's shards alike)."""
    kept = newest_checkpoint(directory)
    then = f"the last good checkpoint, {kept}, is kept" if kept is not None else "no earlier checkpoint exists"
    return f"{_space_needed(directory, kept, written, freed)}; {then}"


def _checkpoint_bytes(checkpoint: Path) -> int:
    """A checkpoint's bytes: its .pt and, if sharded, its shard directory."""
    total = checkpoint.stat().st_size
    shard_dir = shard_dir_of(checkpoint)
    if shard_dir.is_dir():
        total += sum(f.stat().st_size for f in shard_dir.iterdir() if f.is_file())
    return total


def _space_needed(directory: Path, previous: Path | None, written: int, freed: int = 0) -> str:
    """How much the checkpoint needs beside what the disk has free: the size
    of the previous checkpoint (the next is about as large), else at least
    what was written before the failure."""
    try:
        free = f"{(shutil.disk_usage(directory).free + freed) / 2**20:,.1f} MiB free"
    except OSError:
        free = "free space unknown"
    if previous is not None and previous.is_file():
        need = f"about {max(_checkpoint_bytes(previous), written) / 2**20:,.1f} MiB"
    else:
        need = f"more than {written / 2**20:,.1f} MiB"
    return f"a checkpoint needs {need} in {directory} ({free})"


def _save_disk_tables(directory: Path, step: int, state: dict) -> tuple[dict, list[DiskTableSnapshot], dict]:
    """Disk tables (DiskTableSnapshot) write their files now and are replaced
    by their manifests; returns the state to save, the snapshots and the
    files they consist of (name -> size and checksum) for the record."""
    tables = state.get("tables") or {}
    snapshots = [(name, t) for name, t in tables.items() if hasattr(t, "save_files")]
    if not snapshots:
        return state, [], {}
    saved, files = dict(tables), {}
    for name, t in snapshots:
        saved[name] = t.save_files(directory, step)
        files.update(saved[name]["files"])
    return {**state, "tables": saved}, [t for _, t in snapshots], files


def _shard_files(directory: Path, state: dict) -> dict:
    """The files of a sharded checkpoint's shard directory (written by
    shard_write.save_shards on every rank before this save), named
    relative to the checkpoint directory, for the record."""
    tables = state.get("tables")
    if not is_sharded(tables):
        return {}
    name = tables["sharded"]
    if not (directory / name).is_dir():
        raise ValueError(f"save_checkpoint: the shard directory {directory / name} was not written (save_shards first)")
    return {f"{name}/{f}": record for f, record in recorded_files(directory / name).items()}
