"""`trainer.resume=last` (or a path) continues a run with that run's own overrides.

A resumed run must compose the config the run had: before this, a resume
without the original overrides repeated on the command line started from the
schema's defaults and either failed the checkpoint's config check or, for
the keys a resume may change (placement.*, precision.*, trainer.*),
silently continued differently (issue 42 item 5). The run directory keeps
its command line in .hydra/overrides.yaml; `with_saved_overrides` puts those
overrides in front of the command line's, so that an override given again
wins, and says which it took and which the command line replaced.

The run is the one the resume continues. `trainer.resume=last` in a run
directory that has saved overrides (hydra.run.dir=RUN, no
trainer.checkpoint_dir given): that run's, in place (its overrides say
where its checkpoints are). Otherwise the checkpoint is found as the
trainer finds it (restore.locate_resume, from trainer.resume,
trainer.checkpoint_dir and hydra.run.dir as given), and its run directory
is the folder above its checkpoints/ directory, else hydra.run.dir's.
Neither has .hydra/overrides.yaml (a checkpoint kept elsewhere, a run
saved with hydra.output_subdir=null): the checkpoint's own saved config
says the run's values, and every key where it differs from what the command
line composes is taken as key=value (from_checkpoint_config). Sweeps (-m)
take nothing: each job names its own values.

A relative path among the run's overrides (dataset.path=data/x, and the
other PATH_KEYS) was relative to the directory the run started in, which
need not be where it resumes: it is taken made absolute against that
directory, as Hydra recorded it beside the overrides (.hydra/hydra.yaml,
hydra.runtime.cwd). A path the command line gives is its own, as given.

Only the launching process says what it took (RANK 0 or no RANK): torchrun's
other ranks compute the same overrides from the same files, silently.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from recsys_cli.errors import UserError

SAVED = Path(".hydra") / "overrides.yaml"
HYDRA_SAVED = Path(".hydra") / "hydra.yaml"  # Hydra's own config of the run: hydra.runtime.cwd, where it started
# The schema's path-valued keys a resume takes: a relative path in the run's
# overrides was relative to where the run started, not to where it resumes.
PATH_KEYS = ("dataset.path", "dataset.cache_dir", "placement.disk_path", "trainer.checkpoint_dir")
RESUME_KEY = "trainer.resume"
# Not taken from the run resumed: which checkpoint to continue is the command line's own
# choice, and the run resumed may have started from trainer.init_from, which a resume refuses.
NOT_TAKEN = (RESUME_KEY, "trainer.init_from")


@dataclass(frozen=True)
class Restored:
    """The command line a resume composes, and what it says about it."""

    overrides: list[str]  # the run's overrides taken, then the command line's
    source: Path | None = None  # the overrides.yaml or checkpoint read (None: nothing to take)
    taken: list[str] = field(default_factory=list)  # saved overrides added to the command line
    replaced: list[tuple[str, str]] = field(default_factory=list)  # (saved, given): the command line's wins

    def line(self) -> str:
        """What the resume took, for the user ("" when there was nothing to say)."""
        if self.source is None:
            return ""
        if not self.taken and not self.replaced:
            return f"the command line repeats every override of {self.source}"
        where = (f"the run's overrides from {self.source}" if self.source.name == SAVED.name
                 else f"the values of {self.source}'s saved config that differ")
        words = [f"took {where}: " + (" ".join(self.taken) or "none")]
        if self.replaced:
            words.append("the command line's " + ", ".join(f"{given} (not {saved})" for saved, given in self.replaced)
                         + (" wins" if len(self.replaced) == 1 else " win"))
        return "; ".join(words)


def key_of(override: str) -> str:
    """The key (or config group) an override sets: `+a.b=1`, `++a.b=1`, `~a.b` -> `a.b`."""
    return override.partition("=")[0].lstrip("+~")


def _given(overrides: list[str], key: str) -> str | None:
    """The last value the command line gives `key` (None: not given)."""
    found = [o.partition("=")[2] for o in overrides if key_of(o) == key and "=" in o]
    return found[-1] if found else None


def _read_saved(path: Path) -> list[str]:
    import yaml

    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"cannot read the resumed run's overrides {path}: {e}") from None
    if saved is None:
        return []
    if not isinstance(saved, list) or not all(isinstance(o, str) for o in saved):
        raise UserError(f"{path} is not a list of overrides (a run directory's .hydra/overrides.yaml)")
    return saved


def _started_in(source: Path) -> Path | None:
    """The working directory the run of `source` (its .hydra/overrides.yaml)
    started in, as Hydra recorded it beside it (hydra.runtime.cwd); None
    where it did not."""
    import yaml

    try:
        hydra = yaml.safe_load((source.parent.parent / HYDRA_SAVED).read_text())
        cwd = hydra["hydra"]["runtime"]["cwd"]
    except (OSError, yaml.YAMLError, TypeError, KeyError):
        return None
    return Path(cwd) if isinstance(cwd, str) and Path(cwd).is_absolute() else None


def anchored(override: str, cwd: Path | None) -> str:
    """A path key's override with its relative path made absolute against
    `cwd` (the directory the run started in); any other override as it is."""
    left, eq, value = override.partition("=")
    if cwd is None or not eq or key_of(override) not in PATH_KEYS:
        return override
    quote = value[:1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else ""
    path = value[1:-1] if quote else value  # a backslash (an escape in Hydra's grammar): left as written
    if path in ("", "null", "~") or "\\" in path or "${" in path or Path(path).expanduser().is_absolute():
        return override
    return f"{left}={_override_value(str(cwd / path))}"


def run_overrides_file(checkpoint: Path | None, run_dir: Path | None) -> Path | None:
    """The overrides.yaml of the run that wrote `checkpoint`: its run
    directory's (checkpoints/ sits in it), else `run_dir`'s (hydra.run.dir:
    a run resumed in place, its checkpoints kept elsewhere)."""
    candidates = []
    if checkpoint is not None and checkpoint.parent.name == "checkpoints":
        candidates.append(checkpoint.parent.parent / SAVED)
    if run_dir is not None:
        candidates.append(run_dir / SAVED)
    return next((c for c in candidates if c.is_file()), None)


def with_saved_overrides(overrides: list[str], compose: Callable[[list[str]], Any] | None = None) -> Restored:
    """`overrides` (a `recsys train` command line, old group spellings
    already rewritten) with the resumed run's own overrides in front.
    `compose(overrides)`: the config they compose (train/app.check_overrides),
    for a checkpoint whose run saved no overrides (from_checkpoint_config)."""
    resume = _given(overrides, RESUME_KEY)
    if resume in (None, "", "null", "~", "false", "False") or any(o in ("-m", "--multirun") for o in overrides):
        return Restored(list(overrides))
    from recsys_cli.train import restore  # torch: only for a resume

    run_value = _given(overrides, "hydra.run.dir")
    # absolute, as Hydra makes it: the trainer looks for the latest run beside it (restore.locate_resume)
    run_dir = Path(run_value).absolute() if run_value and "${" not in run_value else None
    given_dir = _given(overrides, "trainer.checkpoint_dir")
    checkpoint_dir = Path(given_dir) if given_dir not in (None, "", "null") else (
        run_dir / "checkpoints" if run_dir is not None else None)
    in_place = str(resume).lower() in restore.LATEST_WORDS and given_dir is None
    if in_place and run_dir is not None and (run_dir / SAVED).is_file():
        # the run continued in its own directory: its overrides say where its checkpoints are
        source: Path | None = run_dir / SAVED
    else:
        try:
            checkpoint: Path | None = restore.locate_resume(resume, checkpoint_dir, run_dir)
        except UserError:  # the trainer says so, with the overrides as given
            checkpoint = None
        source = run_overrides_file(checkpoint, run_dir)
        if source is None and checkpoint is not None and compose is not None:
            return from_checkpoint_config(checkpoint, overrides, compose)
    if source is None:
        return Restored(list(overrides))
    given_keys = {key_of(o) for o in overrides}
    started_in = _started_in(source)
    taken, replaced = [], []
    for saved in _read_saved(source):
        key = key_of(saved)
        if key in NOT_TAKEN or key.startswith("hydra."):
            continue
        if key not in given_keys:
            taken.append(anchored(saved, started_in))
            continue
        given = next(o for o in reversed(overrides) if key_of(o) == key)
        if given != saved:
            replaced.append((saved, given))
    return Restored([*taken, *overrides], source, taken, replaced)


def from_checkpoint_config(checkpoint: Path, overrides: list[str], compose: Callable[[list[str]], Any]) -> Restored:
    """The values of the checkpoint's saved config (what the run trained
    with, resolved) that differ from what `overrides` compose, as key=value
    overrides in front of them; a key the command line sets, or a group it
    picks, is the command line's."""
    from recsys_cli import safe_load

    saved = safe_load.torch_file(checkpoint, mmap=True).get("config")  # tensors mapped, not read
    if not isinstance(saved, dict):
        return Restored(list(overrides))  # a checkpoint from before configs were saved
    composed = compose(list(overrides))
    given = {key_of(o) for o in overrides}
    taken = [o for o in _differences(saved, composed) if key_of(o) not in NOT_TAKEN and not any(
        key_of(o) == g or key_of(o).startswith(g + ".") or g.startswith(key_of(o) + ".") for g in given)]
    return Restored([*taken, *overrides], checkpoint, taken, [])


def _differences(saved: dict, now: Any, prefix: str = "") -> list[str]:
    """Overrides that turn the composed config `now` into `saved` where they
    differ, through the schema's groups; a free-form dict of the schema
    (placement.overrides) key by key, added with + and removed with ~ (its
    struct takes no new key otherwise); keys the schema no longer has are
    left out."""
    from omegaconf import DictConfig, OmegaConf

    out: list[str] = []
    for key, value in saved.items():
        if key not in now:
            continue
        node = now[key]
        if isinstance(node, DictConfig) and OmegaConf.get_type(node) is not dict:  # a group of the schema
            if isinstance(value, dict):
                out += _differences(value, node, f"{prefix}{key}.")
            continue
        here: Any = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        if isinstance(value, dict) and isinstance(here, dict):  # free-form: its own keys
            out += [f"{'' if k in here else '+'}{prefix}{key}.{k}={_override_value(v)}"
                    for k, v in value.items() if k not in here or here[k] != v]
            out += [f"~{prefix}{key}.{k}" for k in here if k not in value]
        elif value != here:
            out.append(f"{prefix}{key}={_override_value(value)}")
    return out


_BARE = re.compile(r"[A-Za-z_/.~][\w./:~-]*")


def _override_value(value: Any) -> str:
    """`value` as Hydra's override grammar reads it back (a string quoted
    unless it is a plain word or path that reads as itself)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _BARE.fullmatch(text) and text.lower() not in ("true", "false", "null", "nan", "inf"):
        return text
    # Hydra's quoted strings: a quote is escaped, and so are backslashes before a quote or the end
    escaped = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text).replace("'", "\\'")
    return f"'{escaped}'"


def say_restored(restored: Restored) -> None:
    """Print what the resume took (stdout, beside the trainer's "resumed from" line), on the launching process only."""
    line = restored.line()
    if not line or os.environ.get("RANK", "0") != "0":
        return
    from rich.console import Console

    from recsys_cli.errors import say

    say(Console(), line, "resume:", soft_wrap=True, highlight=False)
