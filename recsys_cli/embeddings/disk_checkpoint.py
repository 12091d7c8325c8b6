"""Checkpoints of disk tables: a base plus deltas of the rows changed since.

Copying a 30 GB table at every checkpoint is what this avoids. A disk
table's entry in a checkpoint is a small manifest naming files in the
checkpoint directory (under disk/<table>/):

  base      the whole table's records at some checkpoint (record layout of
            disk_store.py), or none: the table's initial rows, which are a
            pure function of (seed, table, precision) and are rebuilt
  deltas    in order, the records of the rows changed since the previous
            checkpoint of the chain: [n int64 row ids][n records]

A save writes one delta of the rows changed since the last committed
checkpoint (the store tracks them per table) plus the rows a cache holds
dirty (patched in, encoded as a table snapshot encodes them), so its time
and bytes grow with the rows changed, not with the table. When a chain's
deltas add up to more than COMPACT_FRACTION of the table's rows, or the
checkpoint directory is not the chain's, the save writes a new base instead
(compaction). Every file gets a fresh name and is fsynced and renamed into
place before the checkpoint file that names it; no save ever changes a file
an earlier checkpoint names, so a save killed at any moment leaves the
previous checkpoint whole. The chain only advances (committed) once the
checkpoint and latest.json are in place. Files that no kept checkpoint
names (its step-N.files.json lists them) are deleted after a save.

Loading replays base and deltas into the live file chunk by chunk (bounded
memory); another placement loading a disk table (or `recsys predict`) reads
it whole with materialize().
"""

from __future__ import annotations

import itertools
import os
import re
import uuid
from pathlib import Path

import numpy as np
import torch

from recsys_cli.checksum import Checksum, check_end, check_size
from recsys_cli.embeddings.disk_records import RecordCodec
from recsys_cli.embeddings.quant import CONVERT_STEP, INIT_STEP, RoundingKey, decode_saved, patched_entry
from recsys_cli.embeddings.table_init import TableSpec, init_rows
from recsys_cli.errors import UserError

COMPACT_FRACTION = 0.5  # deltas of more rows than this fraction of the table: write a new base
CHUNK_BYTES = 16 << 20
FORMAT = 1


def is_disk_table(saved) -> bool:
    return isinstance(saved, dict) and "disk" in saved


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _write_file(path: Path, chunks) -> dict:
    """Write byte chunks to a fresh temporary name, fsync, rename; the file's
    size and checksum, computed as the chunks pass (checksum.py)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    checksum = Checksum()
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                checksum.update(view)
                f.write(view)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return checksum.record()


class DiskTableSnapshot:
    """One disk table's entry in a checkpoint until the checkpoint writes it:
    save_files() writes its files and returns the manifest the checkpoint
    holds; committed() advances the store's chain once the checkpoint is in
    place. patch: the function that gives (local ids, encoded rows, state) of
    the rows a cache holds dirty, called by save_files, so that a checkpoint
    holds one table's dirty rows in memory at a time, not every table's.

    It uses only the store's checkpoint methods (disk_store.py): the store
    keeps its own chain and changed rows, so a save is safe whatever other
    threads do (the store is held alone while its table is written, and
    rows changed meanwhile are owed to the next save)."""

    def __init__(self, store, table: int, patch) -> None:
        self.store, self.table, self.patch_of = store, table, patch
        self.spec: TableSpec = store.tables[table]
        self._chain: dict | None = None  # the chain this snapshot's files extend (save_files)
        self._patched_ids: torch.Tensor | None = None

    def save_files(self, directory: Path, step: int) -> dict:
        store, spec = self.store, self.spec
        root = str(Path(directory).resolve())
        folder = Path(directory) / "disk" / _safe(spec.name)
        folder.mkdir(parents=True, exist_ok=True)
        tag = f"{step:08d}-{uuid.uuid4().hex[:8]}"
        patch = self.patch_of() if self.patch_of is not None else None  # before the store's lock: the cache's lock comes first
        self._patched_ids = patch[0].cpu() if patch is not None else None
        with store.exclusive():  # not the trainer's wait on the disk (disk_wait_seconds): the checkpoint's own time
            chain = store.chain(self.table)
            changed = store.take_changed(self.table)
            if self._patched_ids is not None:
                changed = torch.unique(torch.cat([changed, self._patched_ids]))
            if chain is None:  # the table's base is its initial rows
                chain = {"root": root, "base": None, "deltas": [], "delta_rows": 0}
            compact = (chain["root"] != root
                       or chain["delta_rows"] + changed.numel() > COMPACT_FRACTION * spec.num_rows)
            if compact:
                name = folder / f"base-{tag}.bin"
                base = str(name.relative_to(directory))
                sums = {base: _write_file(name, self._base_chunks(patch))}
                chain = {"root": root, "base": base, "deltas": [], "delta_rows": 0, "sums": sums}
            else:
                name = folder / f"delta-{tag}.bin"
                delta = str(name.relative_to(directory))
                sums = {**chain.get("sums", {}), delta: _write_file(name, self._delta_chunks(changed, patch))}
                chain = {**chain, "deltas": [*chain["deltas"], {"file": delta, "rows": changed.numel()}],
                         "delta_rows": chain["delta_rows"] + changed.numel(), "sums": sums}
        self._chain = chain
        names = ([chain["base"]] if chain["base"] else []) + [d["file"] for d in chain["deltas"]]
        files = {n: chain["sums"][n] for n in names}  # every file the entry consists of: size and checksum
        return {"precision": store.precision, "disk": {**self._layout(), **chain, "root": None}, "files": files}

    def committed(self) -> None:
        self.store.commit_checkpoint(self.table, self._chain, self._patched_ids)

    def patched_records(self, local: torch.Tensor, patch) -> torch.Tensor:
        """Records of sorted local rows `local` as a checkpoint saves them: the
        store's, with `patch` (what patch_of() gave) put in. A sharded
        checkpoint (checkpoints/shard_write.py) writes a disk shard this way,
        chunk by chunk, holding the store alone (exclusive())."""
        return self._patched(local, self.store.read_records(self.table, local), patch)

    def _layout(self) -> dict:
        s = self.store
        return {"format": FORMAT, "table": self.spec.name, **s.table_identity(self.table),
                "initial_state": s.initial_state}

    def _patched(self, local: torch.Tensor, records: torch.Tensor, patch) -> torch.Tensor:
        """records of sorted `local` rows with the cache's dirty rows put in."""
        if patch is None:
            return records
        ids, encoded, state = patch
        ids = ids.cpu()
        pos = torch.searchsorted(local, ids)
        inside = (pos < local.numel()) & (local[pos.clamp(max=max(local.numel() - 1, 0))] == ids)
        if bool(inside.any()):
            at = torch.nonzero(inside).flatten()
            packed = self.store.codec.pack({k: v.cpu()[at] for k, v in encoded.items()}, state.cpu()[at])
            records[pos[at]] = packed
        return records

    def _delta_chunks(self, changed: torch.Tensor, patch):
        yield changed.numpy().astype(np.int64)
        step = max(1, CHUNK_BYTES // self.store.record_bytes)
        for a in range(0, changed.numel(), step):
            local = changed[a:a + step]
            yield self._patched(local, self.store.read_records(self.table, local), patch).numpy()

    def _base_chunks(self, patch):
        step = max(1, CHUNK_BYTES // self.store.record_bytes)
        for a in range(0, self.spec.num_rows, step):
            local = torch.arange(a, min(a + step, self.spec.num_rows))
            yield self._patched(local, self.store.read_records(self.table, local), patch).numpy()


def _codec(layout: dict):
    return RecordCodec(layout["dim"], layout["precision"], layout["rounding"], layout["state_width"])


def _path(saved: dict, name: str) -> Path:
    directory = saved.get("directory")
    if directory is None:
        raise UserError("a disk table's checkpoint entry was loaded without its directory (use load_checkpoint)")
    return Path(directory) / name


def _read_exact(f, nbytes: int, path: Path) -> bytes:
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise UserError(f"checkpoint file {path} is truncated ({len(data)} of {nbytes} bytes)")
    return data


class _CheckedFile:
    """A checkpoint file read once from start to end, checked against its
    record: the size when opened, the checksum as the bytes pass (the last
    read raises DamagedFile before its bytes are used). A checkpoint older
    than checksums has no record: read unchecked."""

    def __init__(self, saved: dict, name: str) -> None:
        self.path = _path(saved, name)
        self.expected = saved["disk"].get("sums", {}).get(name)
        self.checksum = Checksum.checking(self.expected)

    def __enter__(self):
        try:
            self.f = open(self.path, "rb")
            if self.expected is not None:
                check_size(self.path, self.f, self.expected)
        except OSError as e:
            raise UserError(f"cannot read checkpoint file {self.path}: {e.strerror or e}") from None
        return self

    def read(self, nbytes: int) -> bytes:
        try:
            data = _read_exact(self.f, nbytes, self.path)
        except OSError as e:
            raise UserError(f"cannot read checkpoint file {self.path}: {e.strerror or e}") from None
        self.checksum.update(data)
        if self.expected is not None and self.checksum.nbytes == self.expected["bytes"]:
            check_end(self.path, self.expected, self.checksum)
        return data

    def __exit__(self, *exc):
        self.f.close()


def _deltas(saved: dict):
    """(local ids, records uint8 [n, R]) chunks of every delta, in order."""
    layout = saved["disk"]
    R = layout["record_bytes"]
    step = max(1, CHUNK_BYTES // R)
    for d in layout["deltas"]:
        n = d["rows"]
        with _CheckedFile(saved, d["file"]) as f:
            ids = np.frombuffer(f.read(8 * n), dtype=np.int64)
            for a in range(0, n, step):
                k = min(step, n - a)
                rec = np.frombuffer(f.read(k * R), dtype=np.uint8).reshape(k, R)
                yield torch.from_numpy(ids[a:a + k].copy()), torch.from_numpy(rec.copy())


def _base(saved: dict, codec):
    """(first local row, records) chunks of the chain's base: a file, or the initial rows."""
    layout = saved["disk"]
    R, n = layout["record_bytes"], layout["rows"]
    step = max(1, CHUNK_BYTES // R)
    if layout["base"] is None:
        first = layout.get("first_row", 0)  # a shard of a table (sharding.py): keyed and drawn as the table's rows
        spec = TableSpec(layout["table"], n, layout["dim"], first, layout.get("table_rows"))
        for a in range(0, n, step):
            b = min(a + step, n)
            local = torch.arange(a, b)
            key = RoundingKey(layout["seed"], torch.full_like(local, layout["table_number"]), local + first, INIT_STEP)
            encoded = codec.rows.encode(init_rows(spec, a, b, layout["seed"]), key)
            state = torch.full((b - a, layout["state_width"]), layout["initial_state"], dtype=torch.float32)
            yield a, codec.pack(encoded, state)
        return
    with _CheckedFile(saved, layout["base"]) as f:
        for a in range(0, n, step):
            k = min(step, n - a)
            rec = np.frombuffer(f.read(k * R), dtype=np.uint8).reshape(k, R)
            yield a, torch.from_numpy(rec.copy())


def materialize(saved):
    """A table entry as native tensors ({"precision", fields, "state"}): a
    disk table is read whole (base and deltas); others are returned as they are."""
    if not is_disk_table(saved):
        return patched_entry(saved)
    layout = saved["disk"]
    codec = _codec(layout)
    records = torch.empty(layout["rows"], layout["record_bytes"], dtype=torch.uint8)
    for a, rec in _base(saved, codec):
        records[a:a + rec.shape[0]] = rec
    for ids, rec in _deltas(saved):
        records[ids] = rec
    fields, state = codec.unpack(records)
    return {"precision": layout["precision"], **fields, "state": state}


def load_disk_table(store, table: int, saved) -> None:
    """Replace table `table` of a DiskRowStore with a checkpoint's entry."""
    layout = saved.get("disk") if is_disk_table(saved) else None
    identity = store.table_identity(table)
    if layout is not None and all(layout[k] == v for k, v in identity.items()):
        # The same layout: replay the chain into the live file, chunk by chunk.
        chain = {k: layout[k] for k in ("base", "deltas", "delta_rows")}
        chain["sums"] = dict(layout.get("sums", {}))
        chain["root"] = str(Path(saved["directory"]).resolve())
        # A chain based on the initial rows, into a table that still holds
        # them (a resume's freshly built store): the deltas alone. Rebuilding
        # the base there would build the table a second time, serially (at
        # MLPerf DLRM-DCNv2's size, most of a resume's start-up).
        base = [] if layout["base"] is None and store.holds_initial_rows(table) else (
            (torch.arange(a, a + rec.shape[0]), rec) for a, rec in _base(saved, store.codec))
        chunks = [base, _deltas(saved)]
        store.replace_table(table, itertools.chain.from_iterable(chunks), chain)
        return
    # Another placement, precision or layout: through native tensors (the table whole);
    # the next save writes a new base (no chain's root is this directory).
    store.replace_table(table, _converted_chunks(store, table, materialize(saved)),
                        {"root": None, "base": None, "deltas": [], "delta_rows": 0})


def _converted_chunks(store, table: int, tensors: dict):
    """(local ids, records) of a table in native tensors, in the store's precision and record layout."""
    spec = store.tables[table]
    lo = store.table_first_row(table)
    step = max(1, CHUNK_BYTES // store.record_bytes)
    for a in range(0, spec.num_rows, step):
        b = min(a + step, spec.num_rows)
        local = torch.arange(a, b)
        state = tensors["state"][a:b]
        if state.shape[1] != store.state_width:
            state = torch.full((b - a, store.state_width), store.initial_state, dtype=torch.float32)
        if tensors["precision"] == store.precision:
            encoded = {name: tensors[name][a:b] for name, *_ in store.codec.fields if name != "state"}
        else:
            part = {k: (v[a:b] if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}
            encoded = store.rows.encode(decode_saved(part, spec.dim), store.key(local + lo, CONVERT_STEP))
        yield local, store.codec.pack(encoded, state)


# --- the checkpoint directory --------------------------------------------------------
def collect_garbage(directory: Path, keep: set[str]) -> None:
    """Delete disk-table files in `directory` that are not in `keep` (the
    files the kept checkpoints' records name), and temporary files of saves
    that were killed."""
    disk = Path(directory) / "disk"
    if not disk.is_dir():
        return
    for f in disk.glob("*/*"):
        if re.fullmatch(r"(base|delta)-\d+-[0-9a-f]+\.bin|\.(base|delta)-.*\.tmp-\d+", f.name):
            if str(f.relative_to(directory)) not in keep:
                f.unlink(missing_ok=True)
