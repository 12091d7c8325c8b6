"""Reading files so that no file can run code (issue 40 item 1).

A checkpoint is a file people share ("here is my trained model"), and its
checksum record guards against damage, not against someone who rewrites the
record to match (checksum.py). So every file recsys unpickles is read here,
in a way that cannot call anything the file names:

* torch files (a checkpoint's step-N.pt, a sharded checkpoint's caches-R.pt,
  an export's format=module scorer): `torch.load(weights_only=True)`, which
  builds only tensors, numbers, strings and plain containers, plus the
  allowlist of safe_globals() below. Anything else (a pickled object whose
  __reduce__ calls os.system) is refused before it is built: UnsafeFile,
  one line naming the file (exit 2).
* DCP's index of a shard directory (.metadata, a plain pickle that
  torch.distributed.checkpoint reads with pickle.load): `dcp_metadata`, an
  unpickler that finds only the DCP metadata classes of DCP_GLOBALS; and
  DCP's own reader goes through SafeFileSystemReader (the same unpickler)
  and a planner that refuses non-tensor items (DCP unpickles those with
  weights_only=False; recsys never writes one).

What recsys writes goes through `plain` first (its str-valued config enums
become the plain strings they equal), so a checkpoint it writes needs no
allowlist at all; the allowlist is for checkpoints written before, whose
disk-table entries held those enums. A file that holds anything else is
refused with the way to convert it, if the user trusts it:
`python -m recsys_cli.safe_load upgrade CHECKPOINT.pt`.
"""

from __future__ import annotations

import io
import pickle
import re
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from recsys_cli.errors import UserError

UPGRADE = "python -m recsys_cli.safe_load upgrade"


class UnsafeFile(UserError):
    """A file that holds something other than plain data: refused unread."""

    def __init__(self, path, what: str, holds: str) -> None:
        upgrade = (f" (if it is a checkpoint of an older recsys that you trust, convert it with `{UPGRADE} {path}`)"
                   if what == "checkpoint file" else "")
        super().__init__(
            f"refused {what} {path}: it holds {holds}, which is not plain data (tensors, numbers, strings, "
            f"containers) and could run code when loaded; recsys never writes one{upgrade}")
        self.path, self.holds = Path(path), holds


def _config_enums() -> list[type]:
    """recsys_cli.config's closed choices (Choice: str-valued Enums)."""
    from recsys_cli import config

    return [c for c in vars(config).values()
            if isinstance(c, type) and issubclass(c, config.Choice) and c is not config.Choice]


def safe_globals() -> list[Any]:
    """What torch's weights_only unpickler may build besides plain data.

    Only recsys_cli.config's Choice enums (PrecisionKind, Rounding, ...):
    checkpoints written before `plain` was applied on save hold PrecisionKind
    and Rounding members in their disk tables' entries (and a disk cache's
    snapshot). Unpickling one calls the Enum class with its value, which
    looks up an existing member: a Choice defines no __new__, _missing_ or
    any other hook, so no code of the file's choosing runs and nothing but a
    member (a str) can come out."""
    return _config_enums()


_allowed = False


def _allow_safe_globals() -> None:
    """torch's allowlist is process-wide (its context manager would take the
    entries away under another thread's load): added once, never removed,
    and only when a file needs it (importing recsys_cli.config imports
    hydra, which loading an export artifact must not)."""
    global _allowed
    if not _allowed:
        torch.serialization.add_safe_globals(safe_globals())
        _allowed = True


def torch_file(path: Path | str, what: str = "checkpoint file", mmap: bool = False) -> Any:
    """torch.load(path, weights_only=True) on the CPU: plain containers,
    tensors, numbers, strings and safe_globals(). A file holding anything
    else is UnsafeFile (one line naming it, nothing of it built); one that
    is not a torch file at all (truncated, foreign) is a UserError naming it."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        # Neither torch.save's zip archive nor a pickle (torch's legacy format): a JSON or text file
        # given as a checkpoint was read by the pickle reader and refused as able to run code.
        raise UserError(f"cannot read {what} {path}: not a file torch.save writes (neither a zip archive nor a "
                        "pickle)")
    for attempt in range(2):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:  # torch's weights_only unpickler refused something
            holds = _refused(str(e))
            if attempt == 0 and not _allowed and holds.startswith("recsys_cli.config."):
                _allow_safe_globals()  # an older checkpoint's enums: allowed, then read again
                continue
            raise UnsafeFile(path, what, holds) from None
        except Exception as e:  # a truncated or foreign file
            raise UserError(f"cannot read {what} {path}: {_first_line(e)}") from None
    raise AssertionError("unreachable")


def _refused(message: str) -> str:
    """What torch's weights_only error says the file holds, in a few words."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return found.group(1)
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", message)
    return found.group(1).rstrip(". ") if found else "something torch's weights_only reader refuses"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def plain(value: Any) -> Any:
    """`value` with every Enum member replaced by its value (recursively
    through dicts, lists and tuples; tensors and everything else as they
    are): what save_checkpoint and the shard caches write, so that
    weights_only reads them without any allowlist."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        items = {k: plain(v) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value  # unchanged: the same object (a state_dict keeps its _metadata)
        if type(value) is dict:
            return items
        out = type(value)(items)  # an OrderedDict: its attributes (a state_dict's _metadata) kept
        out.__dict__.update(getattr(value, "__dict__", {}))
        return out
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        converted = [plain(v) for v in value]
        if all(a is b for a, b in zip(converted, value)):
            return value
        return converted if type(value) is list else tuple(converted)
    return value


# --- DCP's .metadata ------------------------------------------------------------------

# (module, name) -> why an unpickler may find it. These are exactly what
# torch.distributed.checkpoint's FileSystemWriter pickles into .metadata for
# a state dict of plain tensors (what save_shards writes), found by logging
# find_class over a real save (torch 2.13).
DCP_GLOBALS: dict[tuple[str, str], str] = {
    ("torch.distributed.checkpoint.metadata", "Metadata"):
        "the index itself: a dataclass of the three dicts below; unpickled by __new__ and a __dict__ update",
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"):
        "one tensor's dtype/size/chunks: a dataclass, data only",
    ("torch.distributed.checkpoint.metadata", "TensorProperties"):
        "dtype, layout, memory format: a dataclass whose __setstate__ only assigns the fields it is given",
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"):
        "a chunk's offsets and sizes: a dataclass, data only",
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"):
        "a key of storage_data (fqn, offset, index): a frozen dataclass, data only",
    ("torch.distributed.checkpoint.metadata", "StorageMeta"):
        "the save's id and path: a dataclass, data only",
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"):
        "an Enum of memory formats: unpickling looks up an existing member",
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
        "where a key's bytes lie (file, offset, length): a dataclass, data only",
    ("torch", "Size"):
        "a tuple subclass of ints (sizes, offsets): builds a tuple",
    ("torch.serialization", "_get_layout"):
        "how torch pickles a layout: looks a name up in torch's table of layouts, nothing else",
    ("pathlib", "PosixPath"):
        "StorageMeta.checkpoint_id, the directory the save wrote: builds a path object, touches no file",
    ("pathlib._local", "PosixPath"):
        "the same class where Python 3.13+ names its module pathlib._local",
}
# Not allowed, on purpose: BytesStorageMetadata (a non-tensor item, which DCP
# would unpickle with weights_only=False; save_shards writes tensors only),
# builtins, and everything else.


class _NotAllowed(pickle.UnpicklingError):
    """A global the DCP unpickler may not find (its message: module.name)."""


class _DCPUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype object itself (torch.float32): a constant, nothing is called
        raise _NotAllowed(f"{module}.{name}")


def dcp_metadata(path: Path | str) -> Any:
    """DCP's Metadata from `path` (a shard directory's .metadata), unpickled
    finding only DCP_GLOBALS and torch's dtypes: anything else is
    UnsafeFile; a damaged file a UserError naming it."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = Path(path)
    try:
        metadata = _DCPUnpickler(io.BytesIO(path.read_bytes())).load()
    except _NotAllowed as e:
        raise UnsafeFile(path, "shard index", str(e)) from None
    except OSError as e:
        raise UserError(f"cannot read shard index {path}: {e.strerror or e}") from None
    except Exception as e:  # a truncated or foreign file
        raise UserError(f"cannot read shard index {path}: {_first_line(e)}") from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"cannot read shard index {path}: it holds {type(metadata).__name__}, not DCP's Metadata")
    if getattr(metadata, "storage_meta", None) is None:  # as DCP's own reader does
        metadata.storage_meta = StorageMeta()
    return metadata


def safe_dcp_reader(directory: Path | str) -> Any:
    """DCP's FileSystemReader of `directory`, reading .metadata through dcp_metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise UserError(f"{self.path}: per-rank DCP metadata is not read by recsys")
            metadata = dcp_metadata(Path(self.path) / ".metadata")
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(directory)


def tensors_only_planner() -> Any:
    """DCP's default load planner, except that a non-tensor item (which DCP
    unpickles with weights_only=False) is refused."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise UserError(f"refused the shard item {read_item.dest_index.fqn!r}: it is not a tensor "
                            "(recsys writes tensors only)")

    return TensorsOnly()


# --- converting a trusted checkpoint of an older recsys ---------------------------------


def upgrade(path: Path | str) -> str:
    """Re-save the checkpoint at `path` as plain data (the user trusts it:
    this is the one place recsys unpickles with weights_only=False) and
    rewrite its record's entry for the .pt; what it did, in one line."""
    import os

    from recsys_cli.checksum import HashingWriter
    from recsys_cli.checkpoints.record import read_record, record_path, write_record

    path = Path(path)
    if not path.is_file() or path.suffix != ".pt":
        raise UserError(f"{path} is not a checkpoint file (step-N.pt)")
    try:
        torch_file(path)
        return f"{path} already loads with torch.load(weights_only=True): nothing to do"
    except UnsafeFile:
        pass
    state = plain(torch.load(path, map_location="cpu", weights_only=False))
    tmp = path.with_name(f".{path.name}.upgrade.tmp")
    try:
        with open(tmp, "wb") as f:
            out = HashingWriter(f)
            torch.save(state, out)  # type: ignore[arg-type]  # a file object in all but name
            f.flush()
            os.fsync(f.fileno())
        torch_file(tmp)  # what it now holds must load safely, or nothing is replaced
        files = read_record(path)
        if files is not None:
            write_record(path, {**files, path.name: out.checksum.record()})  # type: ignore[dict-item]
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    kept = "its record rewritten" if record_path(path).is_file() else "it has no record"
    return f"{path} converted to plain data ({kept}); it now loads with torch.load(weights_only=True)"


def main(argv: list[str]) -> int:
    from recsys_cli.errors import fail

    if len(argv) != 2 or argv[0] != "upgrade":
        print(f"usage: {UPGRADE} CHECKPOINT.pt (only for a checkpoint you trust: it is unpickled in full)",
              file=sys.stderr)
        return 2
    try:
        print(upgrade(argv[1]))
    except UserError as e:
        fail(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
