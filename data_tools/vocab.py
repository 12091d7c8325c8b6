"""The vocabulary: each sparse feature's raw value -> id mapping, saved with the dataset.

A dataset preprocessed in vocabulary mode keeps, next to its shards,
`vocab/<feature>.values.npy` (the raw 32-bit values that got an id, sorted,
uint32) and `vocab/<feature>.ids.npy` (their ids, int32, same order). Values
not listed (rare, unseen or missing) have id 0. Lookups are one vectorised
binary search (np.searchsorted) over a memory-mapped file, so loading costs
no parsing and memory only for the pages a lookup touches.

Hashing mode needs no files: id = 1 + value % (hash_buckets - 1).

`manifest.options["vocabulary"]` says which (mode, min_count or
hash_buckets), lists the files with their sha256 and byte sizes, and carries
a fingerprint (sha256 over the mapping) that identifies the vocabulary:
datasets preprocessed with `vocab=DIR` copy DIR's files and fingerprint, so a
checkpoint can tell whether a dataset shares its vocabulary.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from data_tools.manifest import MANIFEST_NAME, ManifestError, check_inside, load_manifest, sha256_file

VOCAB_DIR = "vocab"


@dataclass
class FeatureVocab:
    values: np.ndarray  # uint32 [V - 1], sorted ascending
    ids: np.ndarray  # int32 [V - 1], the id of values[i]

    def lookup(self, raw: np.ndarray) -> np.ndarray:
        """int32 id of each uint32 raw value; 0 where the value has no id."""
        raw = np.asarray(raw, dtype=np.uint32)
        if not len(self.values):
            return np.zeros(len(raw), dtype=np.int32)
        pos = np.searchsorted(self.values, raw)
        np.minimum(pos, len(self.values) - 1, out=pos)
        hit = self.values[pos] == raw
        out = self.ids[pos]
        return np.where(hit, out, np.int32(0)).astype(np.int32, copy=False)


class Vocabulary:
    """Every sparse feature's mapping, in feature order."""

    def __init__(self, features: Sequence[str], mode: str, tables: list[FeatureVocab] | None = None,
                 hash_buckets: int | None = None, fingerprint: str = "", directory: Path | None = None):
        self.features = list(features)
        self.mode = mode  # "vocabulary" | "hash"
        self.tables = tables
        self.hash_buckets = hash_buckets
        self.fingerprint = fingerprint
        self.directory = directory

    def lookup(self, f: int, raw: np.ndarray) -> np.ndarray:
        """Ids of feature f's present raw values (uint32)."""
        if self.mode == "hash":
            assert self.hash_buckets is not None, "a hash vocabulary is made with its bucket count"
            return (np.asarray(raw, dtype=np.uint32) % np.uint32(self.hash_buckets - 1)).astype(np.int32) + 1
        assert self.tables is not None, "a vocabulary-mode vocabulary is made with its tables"
        return self.tables[f].lookup(raw)

    def nbytes(self) -> int:
        if self.tables is None:
            return 0
        return sum(t.values.nbytes + t.ids.nbytes for t in self.tables)


# --------------------------------------------------------------------------- writing


def fingerprint(features: Sequence[str], values: Sequence[np.ndarray], ids: Sequence[np.ndarray]) -> str:
    h = hashlib.sha256()
    for name, v, i in zip(features, values, ids):
        h.update(name.encode() + b"\0")
        h.update(np.ascontiguousarray(v, dtype="<u4").tobytes())
        h.update(np.ascontiguousarray(i, dtype="<i4").tobytes())
    return h.hexdigest()


def hash_fingerprint(features: Sequence[str], hash_buckets: int) -> str:
    return hashlib.sha256(f"hash:{hash_buckets}:{','.join(features)}".encode()).hexdigest()


def sorted_mapping(keys: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values sorted ascending as uint32, their ids as int32) from keys and ids in any order."""
    order = np.argsort(keys, kind="stable")
    return np.ascontiguousarray(keys[order], dtype=np.uint32), np.ascontiguousarray(ids[order], dtype=np.int32)


def write_vocabulary(directory: Path, features: Sequence[str], values: Sequence[np.ndarray],
                     ids: Sequence[np.ndarray], options: dict) -> dict:
    """Write the mapping under directory/vocab (the dataset's temporary
    directory: it becomes visible with the shards) and return the manifest
    entry. `values` must be sorted uint32, `ids` int32 of the same length;
    `options` (mode, min_count...) are recorded as given."""
    vdir = Path(directory) / VOCAB_DIR
    vdir.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict] = {}
    for name, v, i in zip(features, values, ids):
        if len(v) > 1 and not (v[1:] > v[:-1]).all():
            raise ValueError(f"vocabulary of {name}: values must be sorted and unique")
        entry: dict[str, object] = {}
        for kind, arr in (("values", np.asarray(v, dtype=np.uint32)), ("ids", np.asarray(i, dtype=np.int32))):
            path = vdir / f"{name}.{kind}.npy"
            np.save(path, arr)
            entry[kind] = {"file": f"{VOCAB_DIR}/{path.name}", "bytes": path.stat().st_size,
                           "sha256": sha256_file(path)}
        entry["size"] = int(len(v))
        files[name] = entry
    return {**options, "features": list(features), "fingerprint": fingerprint(features, values, ids), "files": files,
            "bytes": sum(e["values"]["bytes"] + e["ids"]["bytes"] for e in files.values())}


def copy_vocabulary(source: Path, directory: Path) -> dict:
    """Copy a dataset's vocabulary files into directory/vocab; returns the
    source manifest's vocabulary entry (same files, same fingerprint)."""
    entry = vocabulary_entry(source)
    if entry.get("mode") == "vocabulary":
        vdir = Path(directory) / VOCAB_DIR
        vdir.mkdir(parents=True, exist_ok=True)
        for e in entry["files"].values():
            for kind in ("values", "ids"):
                shutil.copyfile(Path(source) / e[kind]["file"], Path(directory) / e[kind]["file"])
    return entry


# --------------------------------------------------------------------------- reading


def vocabulary_entry(dataset_dir: str | os.PathLike) -> dict:
    """The manifest's vocabulary entry; a ManifestError for a dataset without one."""
    dataset_dir = Path(dataset_dir)
    m = load_manifest(dataset_dir)
    entry = m.options.get("vocabulary")
    if not entry:
        raise ManifestError(
            f"{dataset_dir} has no saved vocabulary (it was preprocessed before vocabularies were saved, "
            "or is not a Criteo dataset): preprocess the training data again"
        )
    _check_entry(dataset_dir / MANIFEST_NAME, entry)
    return entry


def _check_entry(manifest_path: Path, entry: object) -> None:
    """A ManifestError naming the manifest and the key where the vocabulary
    entry lacks what its readers take (a dataset is untrusted input: a
    missing key was a KeyError's traceback)."""
    def bad(what: str) -> ManifestError:
        return ManifestError(f"{manifest_path}: malformed vocabulary entry (options.vocabulary{what})")

    if not isinstance(entry, dict):
        raise bad(f": {type(entry).__name__}, not an object")
    features = entry.get("features")
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise bad(".features: not a list of feature names")
    if not isinstance(entry.get("fingerprint"), str):
        raise bad(".fingerprint: missing")
    mode = entry.get("mode")
    if mode == "hash":
        buckets = entry.get("hash_buckets")
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 2:
            raise bad(f".hash_buckets: {buckets!r}, not a count >= 2")
        return
    if mode != "vocabulary":
        raise bad(f".mode: {mode!r}, not vocabulary or hash")
    files = entry.get("files")
    for name in features:
        e = files.get(name) if isinstance(files, dict) else None
        if not isinstance(e, dict):
            raise bad(f".files.{name}: missing")
        if isinstance(e.get("size"), bool) or not isinstance(e.get("size"), int):
            raise bad(f".files.{name}.size: {e.get('size')!r}, not a count")
        for kind in ("values", "ids"):
            f = e.get(kind)
            if not isinstance(f, dict) or not isinstance(f.get("sha256"), str):
                raise bad(f".files.{name}.{kind}: missing")
            # its files are read, and copied by vocab=DIR: each must lie inside the dataset (a name with
            # `..` made `recsys preprocess vocab=DIR` write over a file beside the output)
            check_inside(manifest_path, f"vocabulary file ({name} {kind})", f.get("file"))


def load_vocabulary(dataset_dir: str | os.PathLike, verify: bool = False) -> Vocabulary:
    """The dataset's vocabulary, memory-mapped; verify=True also checks every
    file's sha256 against the manifest."""
    dataset_dir = Path(dataset_dir)
    entry = vocabulary_entry(dataset_dir)
    features = list(entry["features"])
    if entry["mode"] == "hash":
        return Vocabulary(features, "hash", hash_buckets=int(entry["hash_buckets"]),
                          fingerprint=entry["fingerprint"], directory=dataset_dir)
    tables = []
    for name in features:
        e = entry["files"][name]
        arrays = []
        for kind, dtype in (("values", np.uint32), ("ids", np.int32)):
            path = dataset_dir / e[kind]["file"]
            if not path.is_file():
                raise ManifestError(f"{path}: vocabulary file listed in the manifest is missing")
            if verify and sha256_file(path) != e[kind]["sha256"]:
                raise ManifestError(f"{path}: vocabulary file does not match its sha256 in the manifest")
            try:
                a = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as err:
                raise ManifestError(f"{path}: not a readable .npy file ({err})") from None
            if a.dtype != dtype or a.ndim != 1 or len(a) != e["size"]:
                raise ManifestError(f"{path}: expected {e['size']} {np.dtype(dtype).name} values, "
                                    f"found {a.shape} {a.dtype}")
            arrays.append(a)
        tables.append(FeatureVocab(*arrays))
    return Vocabulary(features, "vocabulary", tables, fingerprint=entry["fingerprint"], directory=dataset_dir)


def read_mapping(directory: Path, features: Sequence[str]) -> Vocabulary:
    """The mapping write_vocabulary wrote under directory/vocab, memory-mapped,
    without a manifest (a dataset being built: its temporary directory)."""
    tables = [FeatureVocab(np.load(Path(directory) / VOCAB_DIR / f"{name}.values.npy", mmap_mode="r"),
                           np.load(Path(directory) / VOCAB_DIR / f"{name}.ids.npy", mmap_mode="r"))
              for name in features]
    return Vocabulary(features, "vocabulary", tables, directory=Path(directory))
