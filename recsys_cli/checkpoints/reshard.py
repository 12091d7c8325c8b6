"""Reading sharded tables back, for any process count (re-sharding).

Reading needs no process group: load_shard gives the entry for any row
range of a table, cut from and joined across the saved pieces that overlap
it (re-sharding 2 -> 1, 1 -> 2, 2 -> 4 on resume); assemble_tables gives
whole tables for one process (predict, evaluate, export; through
read.load_checkpoint). Readers check each file against the manifest before
it is read (DamagedFile: one line naming it), and nothing read can run code
(safe_load.py): caches-R.pt with torch.load(weights_only=True), .metadata
with an unpickler that finds only DCP's metadata classes, DCP's reader
through the same, and non-tensor items refused. The directory's layout and
manifest: layout.py.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recsys_cli import safe_load
from recsys_cli.checkpoints.layout import MANIFEST, METADATA, RECORDS, read_manifest, shard_key
from recsys_cli.checksum import DamagedFile, file_problem
from recsys_cli.embeddings.disk_records import RecordCodec
from recsys_cli.embeddings.quant import patched_entry
from recsys_cli.errors import UserError


@dataclass(frozen=True)
class _Piece:
    table: str
    rank: int
    lo: int
    hi: int
    precision: str
    fields: tuple[str, ...]
    patch: tuple[str, ...]  # empty: no patch
    records: tuple[tuple[str, Any], ...] = ()  # a disk shard's chunk: its record layout (else empty)

    def codec(self) -> RecordCodec:
        layout = dict(self.records)
        return RecordCodec(layout["dim"], layout["precision"], layout["rounding"], layout["state_width"])

    def keys(self) -> dict[tuple[bool, str], str]:
        out = {(False, f): shard_key(self.table, self.lo, self.hi, f) for f in self.fields}
        out.update({(True, f): shard_key(self.table, self.lo, self.hi, f, patch=True) for f in self.patch})
        return out


class ShardReader:
    """One shard directory, read by one process without a process group.
    The manifest is checked when the reader is made, each file once before
    it is first read."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self.pieces = [_Piece(p["table"], p["rank"], p["lo"], p["hi"], p["precision"], tuple(p["fields"]),
                              tuple(p["patch"]), tuple(sorted(p.get("records", {}).items())))
                       for p in self.manifest["pieces"]]
        self._checked: set[str] = set()
        self._metadata: Any = None
        self._file_of: dict[str, str] = {}

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    def tables(self) -> dict[str, int]:
        """table -> its rows, in the manifest's order."""
        return dict(self.manifest["tables"])

    def check(self, name: str) -> Path:
        """The file `name` of the directory, after checking it against the manifest (DamagedFile)."""
        path = self.directory / name
        if name not in self._checked:
            expected = self.manifest["files"].get(name)
            problem = "not in its shard manifest" if expected is None else file_problem(path, expected)
            if problem is not None:
                raise DamagedFile(path, problem)
            self._checked.add(name)
        return path

    def metadata(self) -> Any:
        if self._metadata is None:
            # DCP's reader would pickle.load it: only the DCP metadata classes may be found
            self._metadata = safe_load.dcp_metadata(self.check(METADATA))
            self._file_of = {index.fqn: info.relative_path for index, info in self._metadata.storage_data.items()}
        return self._metadata

    def read(self, piece: _Piece) -> dict:
        """The piece's entry as saved ({"precision", fields, "state", "patch"?})."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = self.metadata()
        keys = piece.keys()
        targets = {}
        for key in keys.values():
            md = metadata.state_dict_metadata.get(key)
            if md is None or key not in self._file_of:
                raise UserError(f"{self.directory}: {key!r} is in its manifest but not in {METADATA}")
            if not isinstance(md, TensorStorageMetadata):  # DCP would unpickle it with weights_only=False
                raise UserError(f"{self.directory / METADATA}: {key!r} is not a tensor (recsys writes tensors only)")
            self.check(self._file_of[key])
            targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
        try:
            with warnings.catch_warnings():  # that it assumes a single process: it is told so
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(targets, storage_reader=safe_load.safe_dcp_reader(self.directory),
                         planner=safe_load.tensors_only_planner(), no_dist=True)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise UserError(f"cannot read the shards of {self.directory}: {str(e).splitlines()[0]}") from None
        entry: dict = {"precision": piece.precision}
        if piece.records:  # a disk shard's records, its dirty rows put in when saved
            fields, state = piece.codec().unpack(targets[keys[(False, RECORDS)]])
            return {**entry, **fields, "state": state}
        entry.update({f: targets[k] for (is_patch, f), k in keys.items() if not is_patch})
        if piece.patch:
            entry["patch"] = {f: targets[k] for (is_patch, f), k in keys.items() if is_patch}
        return entry

    def pieces_of(self, table: str) -> list[_Piece]:
        return sorted((p for p in self.pieces if p.table == table), key=lambda p: p.lo)

    def load(self, table: str, lo: int, hi: int) -> dict:
        """The entry for rows [lo, hi) of `table` (see load_shard)."""
        rows = self.tables().get(table)
        if rows is None:
            raise UserError(f"{self.directory} holds no shard of table {table!r}")
        if not 0 <= lo <= hi <= rows:
            raise UserError(f"rows [{lo}, {hi}) of table {table!r}: it has {rows} rows in {self.directory}")
        pieces = self.pieces_of(table)
        overlapping = [p for p in pieces if p.lo < hi and p.hi > lo]
        covered, gap_end = lo, hi
        for p in overlapping:
            if p.lo > covered:
                gap_end = p.lo
                break
            covered = max(covered, p.hi)
        if covered < hi:
            raise UserError(f"rows [{covered}, {gap_end}) of table {table!r} are in no shard of {self.directory}")
        if lo == hi:  # an empty range: the fields' shapes, no rows
            if not pieces:
                raise UserError(f"table {table!r} has no saved rows in {self.directory}")
            return self._empty(pieces[0])
        precisions = sorted({p.precision for p in overlapping})
        if len(precisions) > 1:
            raise UserError(f"rows [{lo}, {hi}) of table {table!r} were saved in several precisions "
                            f"({', '.join(precisions)}) in {self.directory}")
        if len(overlapping) == 1 and (overlapping[0].lo, overlapping[0].hi) == (lo, hi):
            return self.read(overlapping[0])  # the saved piece itself
        out: dict = {}
        patches: list[dict] = []
        for p in overlapping:
            saved = self.read(p)
            a, b = max(lo, p.lo), min(hi, p.hi)
            for f in (k for k, v in saved.items() if isinstance(v, torch.Tensor)):
                if f not in out:
                    out[f] = torch.empty((hi - lo, *saved[f].shape[1:]), dtype=saved[f].dtype)
                out[f][a - lo:b - lo] = saved[f][a - p.lo:b - p.lo]
            patch = saved.get("patch")
            if patch is not None:
                rows_at = patch["rows"] + (p.lo - lo)  # local to the range asked for
                inside = (rows_at >= a - lo) & (rows_at < b - lo)
                if bool(inside.any()):
                    patches.append({f: (rows_at if f == "rows" else v)[inside] for f, v in patch.items()})
        entry = {"precision": precisions[0], **out}
        if patches:
            entry["patch"] = {f: torch.cat([q[f] for q in patches]) for f in patches[0]}
        return entry

    def _empty(self, piece: _Piece) -> dict:
        md = self.metadata().state_dict_metadata
        entry: dict = {"precision": piece.precision}
        if piece.records:
            codec = piece.codec()
            fields, state = codec.unpack(torch.empty(0, codec.record_bytes, dtype=torch.uint8))
            return {**entry, **fields, "state": state}
        for f in piece.fields:
            m = md[shard_key(piece.table, piece.lo, piece.hi, f)]
            entry[f] = torch.empty((0, *m.size[1:]), dtype=m.properties.dtype)
        return entry

    def caches(self, rank: int, world_size: int) -> Any:
        if world_size != self.world_size:
            return None
        name = f"caches-{rank}.pt"
        if name not in self.manifest["files"]:
            return None
        path = self.check(name)
        saved = safe_load.torch_file(path, "shard file")  # weights_only: code in it is refused, never run
        if not isinstance(saved, dict) or "caches" not in saved:
            raise UserError(f"shard file {path} holds no caches")
        return saved["caches"]

_readers: dict[tuple, ShardReader] = {}


def reader(directory: Path | str) -> ShardReader:
    """The ShardReader of `directory`, kept while the directory is the same
    (so each file is checked once however many ranges are read from it)."""
    directory = Path(directory)
    try:
        st = (directory / MANIFEST).stat()
    except OSError:
        return ShardReader(directory)  # raises: the manifest is missing or unreadable
    key = (str(directory.resolve()), st.st_ino, st.st_mtime_ns, st.st_size)
    found = _readers.get(key)
    if found is None:
        if len(_readers) >= 4:
            _readers.clear()
        found = _readers[key] = ShardReader(directory)
    return found


def load_shard(directory: Path | str, table: str, lo: int, hi: int) -> dict:
    """The entry for rows [lo, hi) of `table`, in table_snapshot's format and
    the precision it was saved in: row tensors cut from and joined across
    the saved pieces that overlap the range (whatever world size saved
    them), the "patch" (dirty cache rows) kept beside, only its rows inside
    the range, ids relative to lo. No collective: each rank reads what it
    needs; only the overlapping pieces are read, and each file is checked
    against the manifest before its first read."""
    return reader(directory).load(table, lo, hi)


def load_rank_caches(directory: Path | str, rank: int, world_size: int) -> Any:
    """What rank `rank` saved of its caches, when the checkpoint was saved by
    `world_size` ranks; None otherwise (the caches then start empty, and the
    tables take their patches)."""
    return reader(directory).caches(rank, world_size)


def assemble_tables(directory: Path | str, keep_patches: bool = False) -> dict[str, dict]:
    """Every table whole, {table: entry}, for one process (predict, evaluate,
    export, a resume without sharding): the patch put in
    (quant.patched_entry), or kept beside when keep_patches."""
    found = reader(directory)
    out = {}
    for table, rows in found.tables().items():
        entry = found.load(table, 0, rows)
        out[table] = entry if keep_patches else patched_entry(entry, in_place=True)
    return out
