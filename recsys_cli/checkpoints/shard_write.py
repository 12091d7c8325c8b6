"""Writing a sharded run's tables (issue 29): every rank writes its own shards, collectively.

A sharded run (embeddings/sharding.py) saves its tables beside the
checkpoint file, in step-NNNNNNNN.shards/ (layout.shard_dir), through
torch.distributed.checkpoint (DCP, the library TorchRec uses); the files
and the manifest: layout.py. A shard on disk (a DiskTableSnapshot) is saved
as pieces of CHUNK_BYTES of its records, each read from the store (its dirty
rows put in) only when DCP writes it: no save holds a table in memory.

The ranks write into .step-NNNNNNNN.shards.tmp/, which rank 0 renames into
place once every file and the manifest are written and fsynced: a save
killed at any moment leaves no directory that looks complete. Each file is
checksummed as its bytes pass to the disk (DCP's writes go through a hashing
stream), the manifest carries its own checksum, and the checkpoint's record
(step-NNNNNNNN.files.json, written by write.save_checkpoint) names every
file of the directory, so `recsys verify` and a resume's search for an
intact checkpoint check the shards too. Reading them back: reshard.py.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist

from recsys_cli import safe_load
from recsys_cli.checkpoints.layout import (MANIFEST, RECORDS, SHARD_FORMAT, SUFFIX, hash_file, shard_key,
                                           write_manifest)
from recsys_cli.checksum import Checksum, HashingWriter
from recsys_cli.embeddings.disk_checkpoint import DiskTableSnapshot
from recsys_cli.errors import UserError, write_error


CHUNK_BYTES = 16 << 20  # a disk shard is read and written this many bytes of records at a time

# After a failed save every rank raises; the others wait this long first, so
# that rank 0's error is the one the launcher reports (it stops them meanwhile).
RANK_0_FIRST_S = 3.0

# What a full disk's error adds about space (write.py's space_note:
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
            out.state[shard_key(table, lo, hi, k)] = _exact(entry[k])
        patch = entry.get("patch")
        patch_fields: list[str] = []
        if patch is not None and patch["rows"].numel():
            patch_fields = list(patch)
            for k, v in patch.items():
                out.state[shard_key(table, lo, hi, k, patch=True)] = _exact(v)
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
        key = shard_key(table, lo + a, lo + b, RECORDS)
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
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
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

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
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
            records[f.name] = hash_file(f)
    pieces = sorted((p for g in gathered for p in g["pieces"]), key=lambda p: (p["table"], p["lo"]))
    tables: dict[str, int] = {}
    for g in gathered:
        for name, hi in g["tables"].items():
            tables[name] = max(tables.get(name, 0), hi)
    for a, b in zip(pieces, pieces[1:]):
        if a["table"] == b["table"] and b["lo"] < a["hi"]:
            raise ValueError(f"save_shards: rows [{b['lo']}, {min(a['hi'], b['hi'])}) of table {a['table']!r} are "
                             f"owned by rank {a['rank']} and rank {b['rank']} (one owner per row)")
    body = {"format": SHARD_FORMAT, "world_size": world_size, "tables": tables, "pieces": pieces,
            "files": dict(sorted(records.items()))}
    write_manifest(tmp / MANIFEST, body)
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_unreferenced(checkpoint_dir: Path | str) -> None:
    """Delete shard directories whose checkpoint file is gone (pruned, or a
    save killed before its .pt was written) and the temporary directories of
    killed saves. Called after the .pt files are pruned (write.prune)."""
    checkpoint_dir = Path(checkpoint_dir)
    for d in checkpoint_dir.glob(f"step-*{SUFFIX}"):
        if d.is_dir() and not (checkpoint_dir / (d.name[: -len(SUFFIX)] + ".pt")).exists():
            shutil.rmtree(d, ignore_errors=True)
    for d in checkpoint_dir.glob(f".step-*{SUFFIX}.*"):
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
