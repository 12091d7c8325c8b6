"""`recsys verify DIR`: check a dataset directory against its manifest, or a
run's checkpoints against their records.

Every shard must exist, have the manifest's size and sha256, and be a
parquet file with the manifest's row count; a saved vocabulary's files must
match their sha256 too. (Training checks sizes when it
opens a dataset and each shard's sha256 when it first reads the shard; this
checks everything up front, e.g. after copying a dataset.)

A run directory (its checkpoints/ folder) or a checkpoint directory: every
file of every checkpoint in it (the .pt, each disk base and delta) must
have the size and checksum its record (step-N.files.json) holds, and every
file recsys unpickles (the .pt, a shard directory's .metadata and
caches-R.pt) must hold plain data only (safe_load.py): one that would be
refused as able to run code is a problem too, found without running it.
"""

from __future__ import annotations

from pathlib import Path

from recsys_cli.errors import UserError


def problems(directory: Path) -> tuple[list[str], int, int]:
    """(one line per damaged or missing shard, shards checked, bytes read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_tools.manifest import load_manifest, sha256_file

    manifest = load_manifest(directory)  # ManifestError: one line already
    found, count, nbytes = [], 0, 0
    for split in manifest.splits.values():
        for shard in split.shards:
            count += 1
            path = directory / shard.file
            if not path.is_file():
                found.append(f"{path}: missing")
                continue
            size = path.stat().st_size
            nbytes += size
            if shard.bytes is not None and size != shard.bytes:
                found.append(f"{path}: {size} bytes, the manifest says {shard.bytes}")
                continue
            if shard.sha256 and sha256_file(path) != shard.sha256:
                found.append(f"{path}: sha256 differs from the manifest's")
                continue
            try:
                rows = pq.read_metadata(path).num_rows
            except (OSError, pa.ArrowException) as e:
                found.append(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})")
                continue
            if rows != shard.rows:
                found.append(f"{path}: {rows} rows, the manifest says {shard.rows}")
    if manifest.options.get("vocabulary"):
        from data_tools.manifest import ManifestError
        from data_tools.vocab import load_vocabulary

        try:
            load_vocabulary(directory, verify=True)
        except ManifestError as e:
            found.append(str(e))
    return found, count, nbytes


def checkpoint_directory(directory: Path) -> Path | None:
    """The checkpoint directory of a run directory (or the directory itself), if it holds checkpoints."""
    for candidate in (directory / "checkpoints", directory):
        if any(candidate.glob("step-*.pt")):
            return candidate
    return None


def verify_checkpoints(directory: Path) -> None:
    from recsys_cli.checkpoints.verify import checkpoint_problems, unsafe_problems

    checkpoints = sorted(directory.glob("step-*.pt"))
    found = [line for ckpt in checkpoints for line in checkpoint_problems(ckpt) or unsafe_problems(ckpt)]
    for line in found[1:]:
        print(f"damaged: {line}")
    if found:
        more = f" ({len(found) - 1} more above)" if len(found) > 1 else ""
        raise UserError(f"{found[0]}{more}; {len(found)} problem(s) in {len(checkpoints)} checkpoint(s) of {directory}")
    print(f"ok: {directory}: {len(checkpoints)} checkpoint(s), every file's size and checksum match its record, "
          "and every file holds plain data only")


EXAMPLES = ("recsys verify data/kaggle", "recsys verify outputs/2026-01-01/12-00-00")
ARGUMENTS = (("DIR", "a preprocessed dataset directory (its manifest.json names every shard), or a run directory "
                     "or checkpoint directory (every checkpoint's files against their records)"),)


def run_verify(args: list[str]) -> None:
    from recsys_cli.options import help_text, wants_help

    if wants_help(args):
        print(help_text("verify", __doc__ or "", EXAMPLES, entries=ARGUMENTS, usage="recsys verify DIR"))
        return
    if len(args) != 1 or args[0].startswith("-"):
        raise UserError("usage: recsys verify DIR (a preprocessed dataset directory, or a run or checkpoint directory)")
    directory = Path(args[0]).expanduser()
    from data_tools.manifest import MANIFEST_NAME

    checkpoints = checkpoint_directory(directory)
    if checkpoints is not None and not (directory / MANIFEST_NAME).is_file():
        return verify_checkpoints(checkpoints)
    found, count, nbytes = problems(directory)
    for line in found[1:]:
        print(f"damaged: {line}")
    if found:
        more = f" ({len(found) - 1} more above)" if len(found) > 1 else ""
        raise UserError(f"{found[0]}{more}; {len(found)} damaged file(s) in a dataset of {count} shards: "
                        "preprocess the data again")
    print(f"ok: {directory}: {count} shards, {nbytes:,} bytes, sizes, sha256 and row counts "
          "(and the vocabulary's sha256, if saved) match the manifest")
