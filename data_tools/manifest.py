"""The manifest: what a preprocessed dataset directory holds.

A dataset directory is valid exactly when it has a manifest.json; every writer
builds the directory under a temporary name and renames it into place last, so
a killed run never leaves something that looks valid.

Shard schema (parquet), shared by every writer and by the loader:
  label    float32   (absent when the manifest says labelled: false)
  dense    fixed_size_list<float32>[13]   (already log(1 + max(x, 0)), missing -> 0)
  <sparse> int32 per one-hot feature (ids in [0, vocab_size)), or
           list<int32> per multi-hot feature
  session  int64, only when the manifest names a session column
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from data_tools.errors import UserError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DENSE_COLUMN = "dense"
LABEL_COLUMN = "label"
SESSION_COLUMN = "session"
NUM_DENSE = 13
CRITEO_DENSE = [f"I{i}" for i in range(1, 14)]
CRITEO_SPARSE = [f"C{i}" for i in range(1, 27)]
SPLITS = ("train", "val", "test")


class ManifestError(UserError, ValueError):
    """A dataset directory that is missing, incomplete, damaged or of another
    format (a user error: the CLI prints it on one line and exits 2)."""


@dataclass
class SparseFeature:
    name: str
    vocab_size: int
    multi_hot: bool = False


@dataclass
class Shard:
    file: str  # relative to the dataset directory
    rows: int
    sha256: str
    bytes: int | None = None  # file size; checked when a loader opens the dataset (absent: not checked)


@dataclass
class Split:
    rows: int
    shards: list[Shard]


@dataclass
class Manifest:
    source: str
    sparse_features: list[SparseFeature]
    splits: dict[str, Split]
    dense_features: list[str] = field(default_factory=lambda: list(CRITEO_DENSE))
    session_column: str | None = None
    options: dict = field(default_factory=dict)
    inputs: list[dict] = field(default_factory=list)
    skipped_lines: int = 0
    labelled: bool = True  # false: the shards have no label column (unlabelled input)
    format_version: int = FORMAT_VERSION

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.sparse_features]

    def feature(self, name: str) -> SparseFeature:
        for f in self.sparse_features:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        d = dict(d)
        d["sparse_features"] = [SparseFeature(**f) for f in d["sparse_features"]]
        d["splits"] = {
            k: Split(rows=v["rows"], shards=[Shard(**s) for s in v["shards"]])
            for k, v in d["splits"].items()
        }
        return cls(**d)

    def save(self, directory: str | os.PathLike) -> None:
        """Write manifest.json atomically (temporary file, fsync, rename)."""
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def load_manifest(directory: str | os.PathLike) -> Manifest:
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if directory.exists() and not directory.is_dir():  # was "does not exist", of a file that does
        raise ManifestError(f"{directory} is a file, not a dataset directory (raw Criteo TSV is preprocessed first: "
                            f"recsys preprocess criteo input={directory} output=DIR)")
    if not directory.is_dir():
        raise ManifestError(f"dataset directory {directory} does not exist")
    if not path.is_file():
        raise ManifestError(
            f"{path} not found: {directory} is not a preprocessed dataset "
            "(run `recsys preprocess criteo input=... output=...` first)"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{path}: malformed manifest (a JSON {type(raw).__name__}, not an object)")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(
            f"{path}: format_version {version!r}, this recsys reads {FORMAT_VERSION}"
        )
    try:
        manifest = Manifest.from_dict(raw)
    except (TypeError, KeyError, AttributeError) as e:
        raise ManifestError(f"{path}: malformed manifest ({e})") from None
    wrong = _wrongly_typed(manifest)
    if wrong:
        raise ManifestError(f"{path}: malformed manifest ({wrong})")
    for name, split in manifest.splits.items():
        for shard in split.shards:
            check_inside(path, f"split {name}'s shard", shard.file)
    return manifest


def _is(value: object, kind: type) -> bool:
    """isinstance, where a bool is no int (JSON's true is not a count)."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _wrongly_typed(m: Manifest) -> str:
    """The first field of a loaded manifest whose JSON type its readers do not
    take ('' if none): a dataset is untrusted input, and a string where a count
    goes was a TypeError's traceback in predict, evaluate and train."""
    checks: list[tuple[str, object, type]] = [
        ("source", m.source, str), ("options", m.options, dict), ("inputs", m.inputs, list),
        ("skipped_lines", m.skipped_lines, int), ("labelled", m.labelled, bool),
        ("dense_features", m.dense_features, list), ("sparse_features", m.sparse_features, list),
    ]
    if m.session_column is not None:
        checks.append(("session_column", m.session_column, str))
    checks += [(f"dense_features[{i}]", f, str) for i, f in enumerate(m.dense_features or [])]
    for i, f in enumerate(m.sparse_features):
        checks += [(f"sparse_features[{i}].name", f.name, str), (f"sparse_features[{i}].vocab_size", f.vocab_size, int),
                   (f"sparse_features[{i}].multi_hot", f.multi_hot, bool)]
    for name, split in m.splits.items():
        checks.append((f"splits.{name}.rows", split.rows, int))
        for j, shard in enumerate(split.shards):
            where = f"splits.{name}.shards[{j}]"
            checks += [(f"{where}.file", shard.file, str), (f"{where}.rows", shard.rows, int),
                       (f"{where}.sha256", shard.sha256, str)]
            if shard.bytes is not None:
                checks.append((f"{where}.bytes", shard.bytes, int))
    for key, value, kind in checks:
        if not _is(value, kind):
            return f"{key}: {value!r} is not {'a count' if kind is int else 'a ' + kind.__name__}"
    return ""


def is_inside(name: object) -> bool:
    """Whether a file name a manifest holds is a relative path that stays in
    its directory (no absolute path, no `..`): a dataset is untrusted input."""
    if not isinstance(name, str) or not name or "\0" in name:
        return False
    parts = Path(name).parts
    return not Path(name).is_absolute() and ".." not in parts


def check_inside(manifest_path: Path, what: str, name: object) -> None:
    """A ManifestError naming the manifest and the key unless `name` is a file inside the dataset directory."""
    if not is_inside(name):
        raise ManifestError(f"{manifest_path}: {what} {name!r} is not a file inside the dataset directory")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
