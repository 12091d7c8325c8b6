"""Checkpoints: everything a resumed run needs to end where an uninterrupted one would.

A checkpoint is one file, step-NNNNNNNN.pt, written to a temporary name and
renamed; latest.json (also renamed into place) names the newest. A run
killed at any moment leaves the previous checkpoint intact. Tables on disk
write their own files first (a base and deltas of changed rows, see
embeddings/disk_checkpoint.py; step-NNNNNNNN.files.json lists them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from recsys_cli.embeddings.disk_checkpoint import collect_garbage, is_disk_table, write_files_list
from recsys_cli.errors import UserError, write_error

LATEST = "latest.json"


def save_checkpoint(directory: Path, step: int, state: dict, keep: int = 2) -> Path:
    path = directory / f"step-{step:08d}.pt"
    tmp = directory / f".{path.name}.tmp"
    latest_tmp = directory / f".{LATEST}.tmp"
    writing = path
    disk_tables = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        state, disk_tables = _save_disk_tables(directory, step, state, path)
        torch.save(state, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        writing = directory / LATEST
        latest_tmp.write_text(json.dumps({"file": path.name, "step": step}))
        os.replace(latest_tmp, directory / LATEST)
    except OSError as e:  # a full disk: the previous checkpoint and latest.json stay as they were
        tmp.unlink(missing_ok=True)
        latest_tmp.unlink(missing_ok=True)
        kept = directory / LATEST
        then = (f"the last good checkpoint, {directory / json.loads(kept.read_text())['file']}, is kept"
                if kept.is_file() else "no earlier checkpoint exists")
        raise write_error(writing, e, then) from None
    for table in disk_tables:  # the checkpoint is in place: disk chains continue from it
        table.committed()
    for old in sorted(directory.glob("step-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    if disk_tables or (directory / "disk").is_dir():
        collect_garbage(directory)
    return path


def _save_disk_tables(directory: Path, step: int, state: dict, path: Path) -> tuple[dict, list]:
    """Disk tables (DiskTableSnapshot) write their files now and are replaced
    by their manifests; the list of files goes beside the checkpoint."""
    tables = state.get("tables") or {}
    snapshots = [(name, t) for name, t in tables.items() if hasattr(t, "save_files")]
    if not snapshots:
        return state, []
    saved, files = dict(tables), []
    for name, t in snapshots:
        saved[name] = t.save_files(directory, step)
        files += saved[name]["files"]
    write_files_list(path, files)
    return {**state, "tables": saved}, [t for _, t in snapshots]


def find_checkpoint(location: str | Path) -> Path:
    """A checkpoint file, or a directory whose latest.json names one."""
    location = Path(location)
    if location.is_file():
        return location
    latest = location / LATEST
    if latest.is_file():
        path = location / json.loads(latest.read_text())["file"]
        if path.is_file():
            return path
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


def load_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file
        raise UserError(f"cannot read checkpoint {path}: {e}") from None
    for table in (state.get("tables") or {}).values() if isinstance(state, dict) else ():
        if is_disk_table(table):  # its files lie beside the checkpoint
            table["directory"] = str(Path(path).parent)
    return state


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
