"""Checkpoints: everything a resumed run needs to end where an uninterrupted one would.

A checkpoint is one file, step-NNNNNNNN.pt, written to a temporary name and
renamed; latest.json (also renamed into place) names the newest. A run
killed at any moment leaves the previous checkpoint intact; a write that
fails (a full disk) removes its temporary file and names the space it
needed. A damaged latest.json (truncated by a full disk or a crash) is not
trusted: the newest step-*.pt, complete since it was renamed into place
whole, is used instead, and a warning says so. Tables on disk
write their own files first (a base and deltas of changed rows, see
embeddings/disk_checkpoint.py).

Every file a checkpoint consists of is checksummed while it is written
(the .pt through HashingWriter: no second read), and its record,
step-NNNNNNNN.files.json (checkpoint_record.py), is renamed into place
before the .pt. load_checkpoint checks the .pt against it before torch
reads it (the disk files are checked as they are read), so a damaged
checkpoint is one line naming the file, for every reader. The .pt holds
plain data only (safe_load.plain on save) and is read with
torch.load(weights_only=True) (safe_load.torch_file): a file that holds
anything that could run code is refused unread, one line naming it.

A sharded run's tables (issue 29) are not in the .pt: its "tables" is a
reference, {"sharded": "step-NNNNNNNN.shards", "plan": ...}, to the
directory beside it that every rank wrote its shards into
(shard_checkpoint.py). The record lists that directory's files too, pruning
removes it with its .pt, and load_checkpoint reads it back as whole tables
(or leaves the reference, for a sharded resume that reads its own rows).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import IO, cast

import torch

from recsys_cli import safe_load
from recsys_cli.checksum import DamagedFile, HashingWriter, file_problem
from recsys_cli.embeddings.disk_checkpoint import collect_garbage, is_disk_table
from recsys_cli.embeddings.quant import patched_entry
from recsys_cli.errors import UserError, warn, write_error
from recsys_cli.train import shard_checkpoint as shards
from recsys_cli.train.checkpoint_record import checkpoint_problems, read_record, record_path, write_record

LATEST = "latest.json"
BEST = "best.json"  # trainer.keep_best: the checkpoint of the best validation so far


def step_file(step: int) -> str:
    return f"step-{step:08d}.pt"


def save_checkpoint(directory: Path, step: int, state: dict, keep: int = 2) -> Path:
    path = directory / step_file(step)
    tmp = directory / f".{path.name}.tmp"
    latest_tmp = directory / f".{LATEST}.tmp"
    writing = path
    disk_tables = []
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
            shutil.rmtree(shards.shard_dir_of(path), ignore_errors=True)
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
    shards.remove_unreferenced(directory)  # after the .pt: a crash in between leaves no .pt without its shards
    referenced: set[str] = set()  # the disk files the remaining checkpoints consist of
    for ckpt in directory.glob("step-*.pt"):
        referenced.update(read_record(ckpt) or {})
    for record in directory.glob("step-*.files.json"):  # of a checkpoint pruned, or of a save killed before its rename
        if not record.with_name(record.name[: -len(".files.json")] + ".pt").exists():
            record.unlink(missing_ok=True)
    if (directory / "disk").is_dir():
        collect_garbage(directory, referenced)


def best_file(directory: Path | None) -> str | None:
    """The checkpoint file best.json names (None: no best yet)."""
    path = Path(directory) / BEST if directory is not None else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["file"]
    except (ValueError, KeyError):
        return None


def best_step(directory: Path) -> int | None:
    name = best_file(directory)
    return int(name[len("step-"):-len(".pt")]) if name else None


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


def _os_error(e: BaseException) -> OSError | None:
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
    shard_dir = shards.shard_dir_of(checkpoint)
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


def read_latest(directory: Path) -> dict | None:
    """latest.json's record ({"file", "step"}); None when it is missing or
    damaged (not JSON, or without the keys)."""
    try:
        record = json.loads((Path(directory) / LATEST).read_text())
        if isinstance(record, dict) and isinstance(record.get("file"), str) and isinstance(record.get("step"), int):
            return record
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return None


def newest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint latest.json names, else the newest step-*.pt (each is
    renamed into place only once it is written whole); None if there is none."""
    directory = Path(directory)
    record = read_latest(directory)
    if record is not None and (directory / record["file"]).is_file():
        return directory / record["file"]
    found = sorted(directory.glob("step-*.pt"))
    return found[-1] if found else None


def _save_disk_tables(directory: Path, step: int, state: dict) -> tuple[dict, list, dict]:
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
    shard_checkpoint.save_shards on every rank before this save), named
    relative to the checkpoint directory, for the record."""
    tables = state.get("tables")
    if not shards.is_sharded(tables):
        return {}
    name = tables["sharded"]
    if not (directory / name).is_dir():
        raise ValueError(f"save_checkpoint: the shard directory {directory / name} was not written (save_shards first)")
    return {f"{name}/{f}": record for f, record in shards.recorded_files(directory / name).items()}


def find_checkpoint(location: str | Path) -> Path:
    """A checkpoint file, or a directory whose latest.json names one."""
    location = Path(location)
    if location.is_file():
        return location
    latest = location / LATEST
    if latest.is_file():
        record = read_latest(location)
        path = location / record["file"] if record is not None else None
        if path is not None and path.is_file():
            return path
        found = newest_checkpoint(location)
        problem = f"{latest} is damaged" if record is None else f"{latest} names {path}, which does not exist"
        if found is None:
            raise UserError(f"{problem}, and {location} holds no other checkpoint (step-*.pt)")
        warn(f"{problem}; using the newest complete checkpoint, {found}")
        return found
    raise UserError(f"no checkpoint at {location} (expected a .pt file or a directory with {LATEST})")


def find_latest_run_checkpoint(outputs: Path) -> Path:
    """The newest checkpoint directory of earlier runs under `outputs`
    (Hydra's outputs/DATE/TIME/checkpoints): `trainer.resume=true` continues the last run."""
    candidates = [p.parent for p in outputs.glob("*/*/checkpoints/" + LATEST)]
    candidates += [p.parent for p in outputs.glob("*/checkpoints/" + LATEST)]
    if not candidates:
        raise UserError(
            f"trainer.resume=true found no checkpoint under {outputs}; "
            "give trainer.checkpoint_dir=DIR or trainer.resume=PATH"
        )
    return find_checkpoint(max(candidates, key=lambda p: (p / LATEST).stat().st_mtime))


def verify_checkpoint_file(path: Path) -> None:
    """DamagedFile unless the .pt has the size and checksum its record
    holds (one read of the file, in bounded chunks). A checkpoint without
    a record (written before checksums, or by hand) is read unchecked,
    with a warning."""
    path = Path(path)
    files = read_record(path)
    expected = files.get(path.name) if files is not None else None
    if expected is None:
        if path.is_file():
            warn(f"{path} has no record of its checksum ({record_path(path).name}): read unchecked")
        return
    problem = file_problem(path, expected)
    if problem is not None:
        raise DamagedFile(path, problem)


def unsafe_problems(path: Path) -> list[str]:
    """One line per file of the checkpoint at `path` that would be refused
    as holding something other than plain data (safe_load.py): the .pt and,
    for a sharded one, its shard directory's .metadata and caches-R.pt. Each
    is unpickled as its readers do (the .pt memory-mapped: its tensors are
    not read); nothing any of them holds is built or run. For `recsys verify`."""
    path = Path(path)
    found: list[str] = []
    checks = [(path, lambda p: safe_load.torch_file(p, mmap=True))]
    directory = shards.shard_dir_of(path)
    if directory.is_dir():
        checks.append((directory / shards.METADATA, safe_load.dcp_metadata))
        checks += [(c, lambda p: safe_load.torch_file(p, "shard file", mmap=True))
                   for c in sorted(directory.glob("caches-*.pt"))]
    for file, load in checks:
        try:
            load(file)
        except safe_load.UnsafeFile as e:
            found.append(str(e))
        except UserError:
            pass  # not unsafe, unreadable: the checksums name a damaged file
    return found


def intact_before(path: Path) -> Path | None:
    """The newest checkpoint older than `path` in its directory whose every
    file matches its record (reads them whole), or None."""
    path = Path(path)
    for older in sorted(path.parent.glob("step-*.pt"), reverse=True):
        if older.name < path.name and not checkpoint_problems(older):
            return older
    return None


def load_checkpoint(path: Path, keep_patches: bool = False, whole_tables: bool = True) -> dict:
    """The checkpoint at `path`, its .pt checked against its record first
    (DamagedFile: one line naming it); a disk table's entry is given its
    directory, where its files are checked as they are read. A host table's
    "patch" (the rows its cache held dirty, saved beside it) is put in,
    unless keep_patches (a resume, which restores the cache that holds them:
    restore.py).

    A sharded checkpoint's tables are read from its shard directory (each
    file checked first) into the same whole-table entries, so every reader
    of a checkpoint reads it unchanged; with whole_tables=False its "tables"
    stays the reference, given the directory's path ("directory"), for a
    sharded resume in which each rank reads its own rows
    (shard_checkpoint.load_shard, load_rank_caches)."""
    verify_checkpoint_file(path)
    state = safe_load.torch_file(path)  # weights_only: a file that holds code is refused, never run
    tables = (state.get("tables") or {}) if isinstance(state, dict) else {}
    if shards.is_sharded(tables):
        directory = _checked_shard_dir(Path(path), tables["sharded"])
        if whole_tables:
            state["tables"] = shards.assemble_tables(directory, keep_patches=keep_patches)
        else:
            state["tables"] = {**tables, "directory": str(directory)}
        return state
    for name, table in tables.items():
        if is_disk_table(table):  # its files lie beside the checkpoint
            table["directory"] = str(Path(path).parent)
        elif isinstance(table, dict) and not keep_patches:  # a cache's dirty rows, saved beside the table: put in (just loaded: in place)
            tables[name] = patched_entry(table, in_place=True)
    return state


def _checked_shard_dir(path: Path, name: str) -> Path:
    """The shard directory a sharded checkpoint names, its manifest checked
    against the checkpoint's record (which binds the .pt to exactly those
    shards; the manifest then checks each file as it is read)."""
    directory = path.parent / name
    expected = (read_record(path) or {}).get(f"{name}/{shards.MANIFEST}")
    manifest = directory / shards.MANIFEST
    if expected is not None:
        problem = file_problem(manifest, expected)
        if problem is not None:
            raise DamagedFile(manifest, problem)
    elif not manifest.is_file():
        raise DamagedFile(manifest, "missing")
    return directory


# What a resumed run may change: where and in what precision the tables live,
# how the trainer runs (but not the batch size: the loader position counts
# batches) and where the dataset lies. Everything else (the model, the
# optimizer, dedup, the dataset's content) must be the checkpoint's.
RESUMABLE = ("placement.", "precision.", "trainer.", "dataset.path", "dataset.cache_dir")
NOT_RESUMABLE = ("trainer.batch_size",)


def _flatten(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    out: dict = {}
    for k, v in node.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def check_resumable(path: Path, saved: dict, current: dict) -> None:
    """UserError naming every key that differs and may not change on resume.
    Keys only one side has (a newer or older config schema) are not compared."""
    a, b = _flatten(saved), _flatten(current)
    differ = [
        f"{key}={a[key]!r} in the checkpoint, {b[key]!r} now"
        for key in sorted(a.keys() & b.keys())
        if a[key] != b[key] and (not key.startswith(RESUMABLE) or key in NOT_RESUMABLE)
    ]
    if differ:
        raise UserError(
            f"checkpoint {path} was trained with another config: {'; '.join(differ)} (a resume may change only "
            "placement.*, precision.*, trainer.* but trainer.batch_size, dataset.path and dataset.cache_dir)"
        )
