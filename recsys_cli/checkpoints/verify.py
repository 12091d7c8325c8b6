"""Checking a checkpoint before it is trusted: each file against its record, nothing that could run code.

load_checkpoint (read.py) checks the .pt against its record before torch
reads it, and a sharded checkpoint's manifest against the record (which
binds the .pt to exactly those shards); the manifest then checks each
shard file as it is read (reshard.py), and a disk table's files are checked
as they are read (embeddings/disk_checkpoint.py). A damaged checkpoint is
one line naming the file, for every reader. `recsys verify` checks every
file of every checkpoint of a run (checkpoint_problems) and that none holds
anything but plain data (unsafe_problems); a resume whose checkpoint is
damaged falls back to the newest intact one before it (intact_before).
"""

from __future__ import annotations

from pathlib import Path

from recsys_cli import safe_load
from recsys_cli.checkpoints.layout import MANIFEST, METADATA, shard_dir_of
from recsys_cli.checkpoints.record import read_record, record_path
from recsys_cli.checksum import DamagedFile, file_problem
from recsys_cli.errors import UserError, warn


def checkpoint_problems(checkpoint: Path) -> list[str]:
    """One line per file of `checkpoint` that is missing or not as recorded
    (reads every file whole); no record at all is a problem too."""
    checkpoint = Path(checkpoint)
    files = read_record(checkpoint)
    if files is None or checkpoint.name not in files:
        return [f"{checkpoint}: no record of its files' checksums ({record_path(checkpoint).name} is missing or "
                "damaged, or the checkpoint is older than checksums)"]
    found = []
    for name, expected in files.items():
        path = checkpoint.parent / name
        problem = file_problem(path, expected) if expected is not None else (
            "missing" if not path.is_file() else None)
        if problem is not None:
            found.append(f"checkpoint file {path} is damaged: {problem}")
    return found


def verify_checkpoint_file(path: Path) -> None:
    """DamagedFile unless the .pt has the size and checksum its record
    holds (one read of the file, in bounded chunks). A checkpoint without
    a record (written before checksums, or by hand) is read unchecked,
    with a warning."""
    path = Path(path)
    files = read_record(path)
    if files is None and record_path(path).is_file():  # a record, but not one: damaged, or not recsys's
        raise DamagedFile(record_path(path), "not a readable record of its checkpoint's files and checksums")
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
    directory = shard_dir_of(path)
    if directory.is_dir():
        checks.append((directory / METADATA, safe_load.dcp_metadata))
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


def checked_shard_dir(path: Path, name: str) -> Path:
    """The shard directory a sharded checkpoint names, its manifest checked
    against the checkpoint's record (which binds the .pt to exactly those
    shards; the manifest then checks each file as it is read)."""
    directory = path.parent / name
    expected = (read_record(path) or {}).get(f"{name}/{MANIFEST}")
    manifest = directory / MANIFEST
    if expected is not None:
        problem = file_problem(manifest, expected)
        if problem is not None:
            raise DamagedFile(manifest, problem)
    elif not manifest.is_file():
        raise DamagedFile(manifest, "missing")
    return directory
