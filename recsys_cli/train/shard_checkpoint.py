"""Checkpoints of sharded tables (issue 29): every rank writes its own shards, any process count reads them.

A sharded run (embeddings/sharding.py) saves its tables beside the
checkpoint file, in step-NNNNNNNN.shards/ (shard_dir), through
torch.distributed.checkpoint (DCP, the library TorchRec uses):

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
"<table>/rows-<lo>-<hi>/patch/<field>": the table and the global row range,
so a reader finds the rows whatever world size saved them. A shard on disk
(a DiskTableSnapshot) is saved as pieces of CHUNK_BYTES of its records
("<table>/rows-<lo>-<hi>/records", its dirty rows put in), each read from
the store only when DCP writes it: no save holds a table in memory.

The ranks write into .step-NNNNNNNN.shards.tmp/, which rank 0 renames into
place once every file and the manifest are written and fsynced: a save
killed at any moment leaves no directory that looks complete. Each file is
checksummed as its bytes pass to the disk (DCP's writes go through a hashing
stream), the manifest carries its own checksum, and the checkpoint's record
(step-NNNNNNNN.files.json, written by checkpoint.save_checkpoint) names
every file of the directory, so `recsys verify` and a resume's search for an
intact checkpoint check the shards too. Readers check each file before it
is read (DamagedFile: one line naming it), and nothing read can run code
(safe_load.py): caches-R.pt with torch.load(weights_only=True), .metadata
with an unpickler that finds only DCP's metadata classes, DCP's reader
through the same, and non-tensor items refused.

Reading needs no process group: load_shard gives the entry for any row
range of a table, cut from and joined across the saved pieces that overlap
it (re-sharding 2 -> 1, 1 -> 2, 2 -> 4 on resume); assemble_tables gives
whole tables for one process (predict, evaluate, export; through
checkpoint.load_checkpoint).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeGuard, cast

import torch
import torch.distributed as dist
import xxhash

from recsys_cli import safe_load
from recsys_cli.checksum import ALGORITHM, Checksum, DamagedFile, HashingWriter, file_problem
from recsys_cli.embeddings.disk_checkpoint import DiskTableSnapshot
from recsys_cli.embeddings.disk_records import RecordCodec
from recsys_cli.embeddings.quant import patched_entry
from recsys_cli.errors import UserError, write_error

SUFFIX = ".shards"
MANIFEST = "shards.json"
FORMAT = 1
METADATA = ".metadata"  # DCP's index file
RECORDS = "records"  # a disk shard's field: its rows' records (disk_records.py)
CHUNK_BYTES = 16 << 20  # a disk shard is read and written this many bytes of records at a time
# After a failed save every rank raises; the others wait this long first, so
# that rank 0's error is the one the launcher reports (it stops them meanwhile).
RANK_0_FIRST_S = 3.0


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


def _key(table: str, lo: int, hi: int, field: str, patch: bool = False) -> str:
    return f"{table}/rows-{lo}-{hi}/{'patch/' if patch else ''}{field}"


# --- saving ---------------------------------------------------------------------------


# What a full disk's error adds about space (train/checkpoint.py's space_note:
# it knows the checkpoints kept; passed in, as that module imports this one).
SpaceNote = Callable[..., str]


def save_shards(directory: Path | str, pieces: dict[str, tuple[int, int, Any]], caches: Any, rank: int,
                world_size: int, group: Any = None, space_note: SpaceNote | None = None) -> Path:
    """Write this rank's shards and caches into `directory` (shard_dir(...));
    collective: every rank of the run calls it at the checkpoint, with the
    pieces it owns ({table: (lo, hi, entry)}, entry as RowStore.table_snapshot
    gives it for rows [lo, hi), its patch ids relative to lo, or a disk
    store's DiskTableSnapshot of the shard) and its cache
    snapshot (EmbeddingBagCollection.cache_snapshot()). group: the process
    group to save over (default: the default group; alone: none). Returns
    `directory`, complete, on every rank; a failure on any rank is an error
    on every rank and leaves nothing that looks like a checkpoint (a write
    that fails is one line naming the file, and for a full disk
    `space_note`'s words on the space needed and the checkpoint kept)."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp")
    together = world_size > 1
    if together and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"save_shards with world_size={world_size} needs an initialised process group")
    if together and dist.get_world_size(group) != world_size:
        raise ValueError(f"save_shards: world_size={world_size}, the process group has {dist.get_world_size(group)}")
    failure: Exception | None = None
    saving = _Saving()
    try:
        saving = _state_dict(pieces, rank)
        if rank == 0:  # a fresh temporary directory (a killed save's is removed)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    except Exception as e:
        failure = _failed(e, tmp, directory.parent, space_note=space_note)
    _agree(failure, together, group, world_size, tmp, rank)
    records: dict[str, dict] = {}
    caches_file = HashingWriter(None)
    try:
        records[f"caches-{rank}.pt"] = _save_caches(tmp / f"caches-{rank}.pt", caches, rank, world_size, caches_file)
    except Exception as e:
        failure = _failed(e, tmp / f"caches-{rank}.pt", directory.parent, caches_file.error, space_note)
    _agree(failure, together, group, world_size, tmp, rank)
    written, failure = _save_dcp(tmp, saving, together, group, rank, space_note)
    _agree(failure, together, group, world_size, tmp, rank)
    records.update(written)
    mine = {"records": records, "pieces": saving.described,
            "tables": {name: hi for name, (lo, hi, _) in pieces.items()}}
    gathered: list[Any] = [mine]
    if together:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine, group=group)
    if rank == 0:
        try:
            _finish(directory, tmp, gathered, world_size)
        except Exception as e:
            failure = _failed(e, directory, directory.parent, space_note=space_note)
    _agree(failure, together, group, world_size, tmp, rank)
    return directory


def _failed(e: BaseException, path: Path, checkpoint_dir: Path, lost: OSError | None = None,
            space_note: SpaceNote | None = None) -> Exception:
    """A rank's failure as it is raised: a failed write (`e`, an OSError
    behind it, or `lost`: one a writer saw that torch's exception lost) is one
    line naming the file, and for a full disk the space a checkpoint needs in
    `checkpoint_dir` and the checkpoint kept, as a one-process save says."""
    failed = lost or _os_error(e)  # the writer's own: it names the file
    if failed is None:  # a bug: raised with its traceback (DCP's CheckpointException is a BaseException)
        if isinstance(e, Exception):
            return e
        wrapped = RuntimeError(f"the checkpoint's shards were not saved: {e!r}")
        wrapped.__cause__ = e
        return wrapped
    where = Path(failed.filename) if failed.filename else path
    if failed.errno != errno.ENOSPC:
        return write_error(where, failed)
    tmp = next((p for p in (path, *path.parents) if p.name.endswith(".tmp")), None)
    try:
        freed = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file()) if tmp is not None else 0
    except OSError:  # another rank's file came or went
        freed = 0
    if space_note is None:
        return write_error(where, failed)
    return write_error(where, failed, space_note(checkpoint_dir, freed=freed))  # free once the save is removed


@dataclass
class _Saving:
    """What one rank's save writes: DCP's state dict (in-memory pieces as
    tensors sharing the store's memory; a disk shard's chunks as meta
    tensors that `producers` fill as DCP writes each), the pieces'
    descriptions for the manifest, and the disk stores held alone meanwhile."""

    state: dict[str, torch.Tensor] = field(default_factory=dict)
    producers: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    described: list[dict] = field(default_factory=list)
    stores: list[Any] = field(default_factory=list)


def _state_dict(pieces: dict[str, tuple[int, int, Any]], rank: int) -> _Saving:
    """The save of this rank's pieces, never a copy of a table in memory.
    Empty pieces (a row-wise range of a table with fewer rows than ranks)
    are left out."""
    out = _Saving()
    for table, (lo, hi, entry) in pieces.items():
        if isinstance(entry, DiskTableSnapshot):
            _disk_piece(out, table, lo, hi, entry, rank)
            continue
        if not isinstance(entry, dict) or "precision" not in entry:
            raise TypeError(f"save_shards: the piece of table {table!r} is not a table entry "
                            f"({type(entry).__name__})")
        if hi <= lo:
            continue
        fields = [k for k, v in entry.items() if isinstance(v, torch.Tensor)]
        for k in fields:
            if entry[k].shape[0] != hi - lo:
                raise ValueError(f"save_shards: {table!r} rows [{lo}, {hi}): field {k!r} has "
                                 f"{entry[k].shape[0]} rows, not {hi - lo}")
            out.state[_key(table, lo, hi, k)] = _exact(entry[k])
        patch = entry.get("patch")
        patch_fields: list[str] = []
        if patch is not None and patch["rows"].numel():
            patch_fields = list(patch)
            for k, v in patch.items():
                out.state[_key(table, lo, hi, k, patch=True)] = _exact(v)
        out.described.append({"table": table, "rank": rank, "lo": lo, "hi": hi, "precision": entry["precision"],
                              "fields": fields, "patch": patch_fields})
    return out


def _disk_piece(out: _Saving, table: str, lo: int, hi: int, snapshot: DiskTableSnapshot, rank: int) -> None:
    """A disk shard as pieces of CHUNK_BYTES of its records, each read (its
    cache's dirty rows put in) only when DCP writes it: a save holds one
    chunk in memory, not the shard."""
    store = snapshot.store
    if hi - lo != snapshot.spec.num_rows:
        raise ValueError(f"save_shards: {table!r} rows [{lo}, {hi}) but its disk shard has {snapshot.spec.num_rows}")
    patch = snapshot.patch_of() if snapshot.patch_of is not None else None  # before the store's lock, as save_files
    layout = {"dim": store.dim, "precision": store.precision, "rounding": store.codec.rounding,
              "state_width": store.state_width}
    step = max(1, CHUNK_BYTES // store.record_bytes)
    for a in range(0, hi - lo, step):
        b = min(a + step, hi - lo)
        key = _key(table, lo + a, lo + b, RECORDS)
        out.state[key] = torch.empty((b - a, store.record_bytes), dtype=torch.uint8, device="meta")
        out.producers[key] = functools.partial(snapshot.patched_records, torch.arange(a, b), patch)
        out.described.append({"table": table, "rank": rank, "lo": lo + a, "hi": lo + b,
                              "precision": store.precision, "fields": [RECORDS], "patch": [], "records": layout})
    if store not in out.stores:
        out.stores.append(store)


def _exact(t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor whose storage is exactly its bytes, sharing them. A
    table snapshot's tensors are row ranges of a store: DCP would clone a
    view of a larger storage (a copy of the shard in memory at every
    checkpoint) and torch.save would write all of it."""
    t = t.detach().cpu()
    if t.untyped_storage().nbytes() == t.nbytes or not t.is_contiguous() or t.nbytes == 0:
        return t  # its own storage already (or DCP's clone costs nothing worth saving)
    start = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()[start:start + t.nbytes]  # shares the memory
    return torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape, t.stride())


def _save_caches(path: Path, caches: Any, rank: int, world_size: int, out: HashingWriter) -> dict:
    """Write rank's cache snapshot through `out` (its file set here): a write's
    OSError stays in out.error whatever torch raises."""
    with open(path, "wb") as f:
        out.f = f
        torch.save(safe_load.plain({"rank": rank, "world_size": world_size, "caches": caches}), cast(IO[bytes], out))
        f.flush()
        os.fsync(f.fileno())
    return out.checksum.record()


def _save_dcp(tmp: Path, saving: _Saving, together: bool, group: Any, rank: int,
              space_note: SpaceNote | None = None) -> tuple[dict, Exception | None]:
    """DCP's save into `tmp` (collective when together); the records of the
    files this rank wrote, checksummed as they were written, and this rank's
    failure (None: saved; every rank then agrees). Disk stores are held alone
    while their chunks are read."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
    fs = _hashing_file_system()()
    writer.fs = fs
    try:
        with warnings.catch_warnings(), ExitStack() as held:  # alone, DCP warns it assumes one process: it is told
            warnings.simplefilter("ignore", UserWarning)
            for store in saving.stores:
                held.enter_context(store.exclusive())
            dcp.save(saving.state, storage_writer=writer, planner=_planner(saving.producers),
                     process_group=group if together else None, no_dist=not together)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP raises CheckpointException (a BaseException) on every rank
        # A full disk inside DCP's torch.save is a RuntimeError ("unexpected pos")
        # with no OSError behind it: the stream this rank wrote through kept it.
        return {}, _failed(e, tmp, tmp.parent, fs.failed, space_note)
    return {name: c.record() for name, c in fs.written.items() if (tmp / name).is_file()}, None


def _planner(producers: dict[str, Callable[[], torch.Tensor]]) -> Any:
    """DCP's default save planner, except that a key in `producers` is made
    when DCP writes it (a disk shard's chunk: planned from a meta tensor)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class LazySavePlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            make = producers.get(index.fqn)
            return make() if make is not None else super().lookup_object(index)

    return LazySavePlanner()


@functools.cache
def _hashing_file_system() -> type:
    """DCP's FileSystem whose written files are checksummed as their bytes
    pass (written: file name -> Checksum). Built on first use: importing DCP
    costs half a second that predict and export need not pay."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.written: dict[str, Checksum] = {}
            self.failed: OSError | None = None  # the first OSError a write raised (a full disk)

        @contextmanager
        def create_stream(self, path, mode):
            try:
                with super().create_stream(path, mode) as stream:
                    if "w" not in mode:
                        yield stream
                        return
                    hashed = _HashingStream(stream)
                    yield hashed
            except OSError as e:  # a write, or the flush at close (a full disk): torch's error may lose it
                if self.failed is None:
                    self.failed = e if e.filename else OSError(e.errno, e.strerror, str(path))
                raise
            if not hashed.tainted:
                self.written[Path(path).name] = hashed.checksum

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            done = self.written.pop(Path(path).name, None)
            if done is not None:
                self.written[Path(new_path).name] = done

    return HashingFileSystem


class _HashingStream:
    """A file DCP writes through: every byte is checksummed on its way to the
    file. A seek (which DCP does not do today) makes the checksum unusable:
    the file is then hashed by reading it back (_finish)."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.checksum, self.tainted = raw, Checksum(), False

    def write(self, data: Any) -> int:
        self.checksum.update(data)
        return self.raw.write(data)

    def seek(self, *args: Any) -> int:
        self.tainted = True
        return self.raw.seek(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close...
        return getattr(self.raw, name)


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind a failed save: `e`, its cause or context, or one a
    rank raised inside DCP's CheckpointException; None for any other failure."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError):
            return e
        for wrapped in getattr(e, "failures", {}).values():
            found = _os_error(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
            if found is not None:
                return found
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _agree(failure: Exception | None, together: bool, group: Any, world_size: int, tmp: Path,
           rank: int) -> None:
    """Every rank learns whether any rank failed (collective when together):
    the failing rank raises its own error, the others one naming it; rank 0
    removes the temporary directory first. A rank's error the user can act on
    (a full disk) wins over another's bug it caused (DCP's collective
    exception): every rank then says it in one line."""
    mine = None if failure is None else (str(failure), isinstance(failure, UserError))
    reports: list[Any] = [mine]
    if together:
        reports = [None] * world_size
        dist.all_gather_object(reports, mine, group=group)
    failed = [(r, m) for r, m in enumerate(reports) if m is not None]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    said = [(r, message) for r, (message, user) in failed if user]
    if said and together and rank != 0:
        # Rank 0 reports a user's error: `recsys train trainer.nproc=N` prints
        # the first rank to fail, and stops the others once one has (issue 40 problem 5).
        time.sleep(RANK_0_FIRST_S)
    if failure is not None and (isinstance(failure, UserError) or not said):
        raise failure
    r, message = (said or [(r, m) for r, (m, _) in failed])[0]
    raise UserError(f"the checkpoint's shards were not saved: rank {r} failed: {message}")


def _finish(directory: Path, tmp: Path, gathered: list[dict], world_size: int) -> None:
    """Rank 0, once every rank has written: the manifest, then the rename into place."""
    records: dict[str, dict] = {}
    for g in gathered:
        records.update(g["records"])
    for f in sorted(tmp.iterdir()):  # a file no stream hashed, or not whole: hashed from the disk
        recorded = records.get(f.name)
        if recorded is None or recorded["bytes"] != f.stat().st_size:
            records[f.name] = _hash_file(f)
    pieces = sorted((p for g in gathered for p in g["pieces"]), key=lambda p: (p["table"], p["lo"]))
    tables: dict[str, int] = {}
    for g in gathered:
        for name, hi in g["tables"].items():
            tables[name] = max(tables.get(name, 0), hi)
    for a, b in zip(pieces, pieces[1:]):
        if a["table"] == b["table"] and b["lo"] < a["hi"]:
            raise ValueError(f"save_shards: rows [{b['lo']}, {min(a['hi'], b['hi'])}) of table {a['table']!r} are "
                             f"owned by rank {a['rank']} and rank {b['rank']} (one owner per row)")
    body = {"format": FORMAT, "world_size": world_size, "tables": tables, "pieces": pieces,
            "files": dict(sorted(records.items()))}
    _write_manifest(tmp / MANIFEST, body)
    _fsync_dir(tmp)
    old = None
    if directory.exists():  # this step saved again: the earlier directory goes once the new one is in place
        old = directory.with_name(f".{directory.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(directory, old)
    try:
        os.replace(tmp, directory)
    except OSError:
        if old is not None:  # the earlier save stays in place
            os.replace(old, directory)
        raise
    _fsync_dir(directory.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _hash_file(path: Path) -> dict:
    got = Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            got.update(chunk)
    return got.record()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(path: Path, body: dict) -> None:
    """One line of JSON, then a line with its own XXH3-64: the manifest is
    checked before anything it says is trusted."""
    text = json.dumps(body, sort_keys=True)
    with open(path, "w") as f:
        f.write(f"{text}\n{ALGORITHM} {xxhash.xxh3_64_hexdigest(text.encode())}\n")
        f.flush()
        os.fsync(f.fileno())


def _read_manifest(directory: Path) -> dict:
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
    if manifest.get("format") != FORMAT:
        raise UserError(f"{path}: shard format {manifest.get('format')!r}, this recsys reads {FORMAT}")
    return manifest


def recorded_files(directory: Path | str) -> dict[str, dict]:
    """Every file of a complete shard directory with its size and checksum
    (names relative to it), the manifest included: what the checkpoint's
    record lists (checkpoint.save_checkpoint)."""
    directory = Path(directory)
    files = dict(_read_manifest(directory)["files"])
    files[MANIFEST] = _hash_file(directory / MANIFEST)
    return files


def remove_unreferenced(checkpoint_dir: Path | str) -> None:
    """Delete shard directories whose checkpoint file is gone (pruned, or a
    save killed before its .pt was written) and the temporary directories of
    killed saves. Called after the .pt files are pruned (checkpoint.prune)."""
    checkpoint_dir = Path(checkpoint_dir)
    for d in checkpoint_dir.glob(f"step-*{SUFFIX}"):
        if d.is_dir() and not (checkpoint_dir / (d.name[: -len(SUFFIX)] + ".pt")).exists():
            shutil.rmtree(d, ignore_errors=True)
    for d in checkpoint_dir.glob(f".step-*{SUFFIX}.*"):
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


# --- reading --------------------------------------------------------------------------


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
        out = {(False, f): _key(self.table, self.lo, self.hi, f) for f in self.fields}
        out.update({(True, f): _key(self.table, self.lo, self.hi, f, patch=True) for f in self.patch})
        return out


class ShardReader:
    """One shard directory, read by one process without a process group.
    The manifest is checked when the reader is made, each file once before
    it is first read."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.manifest = _read_manifest(self.directory)
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
            m = md[_key(piece.table, piece.lo, piece.hi, f)]
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
