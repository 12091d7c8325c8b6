"""The dataset output directory: built aside, renamed into place, replacing only what the tool wrote.

Every dataset writer (Criteo preprocessing, synthetic data) builds its
output under `<output>.tmp-<pid>` and renames it into place once every shard
and the manifest are written (`atomic_dataset_dir`): a killed run leaves at
most a `.tmp-<pid>` directory (removed by the next run writing the same
output, once its process is gone), never a half-written dataset at the
output path. Replacing an existing dataset replaces only what its writer
wrote (the files in its `.recsys-files.json`, or its manifest and shards);
anything else a user keeps in the directory stays.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from data_tools.errors import UserError
from data_tools.manifest import MANIFEST_NAME, is_inside
from data_tools.stale import remove_dead


# --------------------------------------------------------------------------- atomic directory


def is_dataset_dir(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST_NAME).is_file()


def remove_stale_temps(output: Path) -> None:
    """Remove `<output>.tmp-<pid>` / `.old-<pid>` directories left by killed runs (dead pids only)."""
    remove_dead(output.parent, re.escape(output.name) + r"\.(?:tmp|old)-([0-9]+)(?:-.*)?")


def check_output(output: Path) -> None:
    """Fail early (before any work) when `output` cannot become a dataset directory."""
    if output.exists() or output.is_symlink():
        if output.is_dir() and (is_dataset_dir(output) or not any(output.iterdir())):
            return
        kind = "a file" if not output.is_dir() else "a non-empty directory without a manifest.json"
        raise UserError(
            f"output {output} exists and is {kind}; refusing to overwrite it "
            "(remove it or choose another output)"
        )


@contextlib.contextmanager
def atomic_dataset_dir(output: str | os.PathLike, if_exists: str = "replace") -> Iterator[Path]:
    """Yield a temporary directory next to `output`; on normal exit rename it to
    `output`. On an exception the temporary directory is removed and `output`
    is left as it was.

    if_exists="replace": an existing dataset (or empty directory) at `output` is
    replaced. if_exists="keep": if `output` became a dataset meanwhile (another
    process won a race), the new directory is discarded and the existing one kept.
    """
    output = Path(output).expanduser().absolute()
    check_output(output)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the parent directory of output {output}: {e.strerror or e}") from None
    remove_stale_temps(output)
    tmp = output.with_name(f"{output.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
    except OSError as e:
        raise UserError(f"output {output} is not writable: {e.strerror or e}") from None
    try:
        yield tmp
        if not (tmp / MANIFEST_NAME).is_file():
            raise RuntimeError(f"internal error: {tmp} has no manifest at commit time")
        _commit(tmp, output, if_exists)
    except OSError as e:  # a full disk, mostly: one line, and nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        reason = "no space left on device" if _is_enospc(e) else str(e).splitlines()[0]
        raise UserError(f"cannot write the dataset {output} (built in {tmp}): {reason}; "
                        f"{output} is as it was") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _is_enospc(e: OSError) -> bool:
    # pyarrow's IO errors carry the errno only in their text
    return e.errno == errno.ENOSPC or "No space left on device" in str(e) or "errno 28" in str(e)


WRITTEN_LIST = ".recsys-files.json"  # the files a writer put in a dataset directory: all it may replace


def _files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink())


def written_files(directory: Path) -> set[str]:
    """What a writer put in `directory` and may replace: the list it left
    there, or (datasets written by other tools) the manifest and its shards."""
    import json

    from data_tools.manifest import load_manifest

    listed = directory / WRITTEN_LIST
    if listed.is_file():
        try:  # names inside the directory only: what it lists is moved away, then deleted
            return {f for f in json.loads(listed.read_text()) if is_inside(f)} | {WRITTEN_LIST}
        except (ValueError, TypeError):
            pass
    try:
        m = load_manifest(directory)
    except ValueError:
        return {MANIFEST_NAME}
    return {MANIFEST_NAME, *(shard.file for split in m.splits.values() for shard in split.shards)}


def _move(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)


def _commit(tmp: Path, output: Path, if_exists: str) -> None:
    import json

    new = [f for f in _files_under(tmp) if f != MANIFEST_NAME]
    (tmp / WRITTEN_LIST).write_text(json.dumps([*new, MANIFEST_NAME, WRITTEN_LIST]))
    try:
        os.rename(tmp, output)  # atomic when output is absent or an empty directory
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise UserError(f"cannot move the new dataset into place at {output}: {e.strerror or e}") from None
    if if_exists == "keep" and is_dataset_dir(output):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    check_output(output)  # still a dataset: we may replace it
    # Replace only what the previous writer wrote (its list, or its manifest
    # and shards): a user's own files in the directory stay where they are.
    owned = written_files(output)
    for f in new:
        # the file, or a folder on its way that is a file (a user's `train` where the shards go in train/)
        taken = next((p for p in [*reversed(Path(f).parents[:-1]), Path(f)]
                      if (output / p).exists() and not (p != Path(f) and (output / p).is_dir())), None)
        if taken is not None and taken.as_posix() not in owned:
            raise UserError(
                f"output {output} holds {taken.as_posix()}, which recsys did not write; refusing to overwrite it "
                "(move it away or choose another output)"
            )
    old = output.with_name(f"{output.name}.old-{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    old.mkdir()
    # The old manifest goes first (the directory stops being a dataset), the
    # new one comes last (it is a dataset again only when complete).
    moved_old: list[str] = []
    moved_new: list[str] = []
    folders = {(output / f).parent for f in new}
    had = {d for d in folders if d.is_dir()}
    try:
        for f in [MANIFEST_NAME, *sorted(owned - {MANIFEST_NAME})]:
            if (output / f).is_file():
                _move(output / f, old / f)
                moved_old.append(f)
        for f in [*new, WRITTEN_LIST, MANIFEST_NAME]:
            _move(tmp / f, output / f)
            moved_new.append(f)
    except OSError:
        # Put the previous dataset back as it was (the caller says so): the
        # new files out, the old ones in, the folders made for the new ones gone.
        for f in reversed(moved_new):
            (output / f).unlink(missing_ok=True)
        for f in reversed(moved_old):
            _move(old / f, output / f)
        for d in sorted(folders - had, key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        shutil.rmtree(old, ignore_errors=True)
        raise
    for d in sorted({(output / f).parent for f in owned}, key=lambda p: -len(p.parts)):
        if d != output and d.is_dir() and not any(d.iterdir()):
            d.rmdir()  # a split directory the old dataset had and the new one does not
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
