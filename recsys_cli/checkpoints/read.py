"""Finding and loading checkpoints: what every reader of one (resume, predict, evaluate, export) calls.

latest.json names the newest checkpoint; a damaged latest.json (truncated by
a full disk or a crash) is not trusted: the newest step-*.pt, complete since
it was renamed into place whole, is used instead, and a warning says so.
load_checkpoint checks the .pt against its record before torch reads it
(verify.py) and reads it with torch.load(weights_only=True)
(safe_load.torch_file): a file that holds anything that could run code is
refused unread, one line naming it.

A sharded checkpoint's "tables" is a reference to its shard directory
(layout.py); load_checkpoint reads it back as whole tables (reshard.py), or
leaves the reference, for a sharded resume in which each rank reads its own
rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from recsys_cli import safe_load
from recsys_cli.checkpoints.layout import BEST, LATEST, is_sharded, step_file
from recsys_cli.checkpoints.reshard import assemble_tables
from recsys_cli.checkpoints.verify import checked_shard_dir, verify_checkpoint_file
from recsys_cli.embeddings.disk_checkpoint import is_disk_table
from recsys_cli.embeddings.quant import patched_entry
from recsys_cli.errors import UserError, warn


def read_latest(directory: Path) -> dict | None:
    """latest.json's record ({"file", "step"}); None when it is missing or
    damaged (not JSON, without the keys, or naming another file than its
    step's checkpoint beside it: "../../other-run/checkpoints/step-N.pt", or
    an absolute path, took a resume out of the directory to whatever it named)."""
    try:
        record = json.loads((Path(directory) / LATEST).read_text())
        if isinstance(record, dict) and type(record.get("step")) is int and record.get("file") == step_file(
                record["step"]):
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


def best_file(directory: Path | None) -> str | None:
    """The checkpoint file best.json names (None: no best yet)."""
    path = Path(directory) / BEST if directory is not None else None
    if path is None or not path.is_file():
        return None
    try:
        name = json.loads(path.read_text()).get("file")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return None
    # a damaged best.json (another file, not a name: '[1]', 'step-0000001x.pt') was a traceback on resume
    return name if isinstance(name, str) and re.fullmatch(r"step-\d{8}\.pt", name) else None


def best_step(directory: Path) -> int | None:
    name = best_file(directory)
    return int(name[len("step-"):-len(".pt")]) if name else None


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
    (reshard.load_shard, load_rank_caches)."""
    verify_checkpoint_file(path)
    state = safe_load.torch_file(path)  # weights_only: a file that holds code is refused, never run
    tables = (state.get("tables") or {}) if isinstance(state, dict) else {}
    if is_sharded(tables):
        directory = checked_shard_dir(Path(path), tables["sharded"])
        if whole_tables:
            state["tables"] = assemble_tables(directory, keep_patches=keep_patches)
        else:
            state["tables"] = {**tables, "directory": str(directory)}
        return state
    for name, table in tables.items():
        if is_disk_table(table):  # its files lie beside the checkpoint
            table["directory"] = str(Path(path).parent)
        elif isinstance(table, dict) and not keep_patches:  # a cache's dirty rows, saved beside the table: put in (just loaded: in place)
            tables[name] = patched_entry(table, in_place=True)
    return state
