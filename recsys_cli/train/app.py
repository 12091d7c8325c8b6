"""`recsys train`: the Hydra app around the Trainer."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from recsys_cli import config_dirs
from recsys_cli.config import register_configs
from recsys_cli.config_groups import group_overrides
from recsys_cli.errors import UserError, fail, say, write_error
from recsys_cli.train import rundir
from recsys_cli.train.preemption import Preempted, say_preempted  # no torch

# Nothing here imports torch at module level: a bad config is reported
# before the heavy modules load (check_overrides validates it first).

# configs/ of the repository, as installed with the package (config_dirs.py)
CONFIG_DIR = str(config_dirs.config_dir(config_dirs.TRAIN))


# Where Hydra would save the composed config (hydra.output_subdir): Hydra
# writes it before the app runs, so a second run in a busy directory would
# overwrite the first one's, and a refused resume the run's own; the app saves it
# itself once it holds the lock and the Trainer is set up (a resume accepted).
_output_subdir: str | None = ".hydra"
_started = False  # the app ran: Hydra accepted the command line
_existing: set[Path] = set()  # run/sweep directories named on the command line that existed before Hydra ran


def train_main(cfg: DictConfig) -> float | None:
    global _started
    _started = True
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    from recsys_cli.train import distributed  # torch: only once the config is known to be good

    # what Hydra just made for this run: removed again if the start fails before any output
    created = rundir.unused_dirs(run_dir, Path.cwd(), _existing) if os.environ.get("RANK", "0") == "0" else []
    # The run's record (.hydra/), written once the Trainer is set up (_train): a refused resume
    # (another config, other features, no memory) leaves the record of the run it would continue as it was.
    record = (functools.partial(save_hydra_config, hydra_files(cfg), run_dir / _output_subdir)
              if _output_subdir is not None else None)
    try:
        distributed.check_process_count(cfg)  # before the run directory is made: nothing is written
        with contextlib.ExitStack() as locks:
            locks.enter_context(rundir.locked(run_dir))
            if cfg.trainer.checkpoint_dir and os.environ.get("RANK", "0") == "0":
                locks.enter_context(rundir.locked(Path(cfg.trainer.checkpoint_dir), "checkpoint directory"))
            checkpoint_dir = Path(cfg.trainer.checkpoint_dir) if cfg.trainer.checkpoint_dir else None
            if not cfg.trainer.resume:  # a new run: never over another run's metrics and checkpoints
                rundir.refuse_reuse(run_dir, checkpoint_dir)
            else:  # a resume: in its own run's directory, or in one that holds no other run
                resumed = _resumed_checkpoint(cfg.trainer.resume, checkpoint_dir, run_dir)
                if resumed is not None:
                    rundir.refuse_resume_into_another_run(run_dir, checkpoint_dir, resumed)
            return _train(cfg, run_dir, record)
    except UserError as e:
        rundir.remove_unused(created)  # after the lock is released
        fail(str(e))
    except Preempted as e:  # one process; ranks report their own (distributed_app)
        say_preempted(str(e))


def _resumed_checkpoint(resume: str, checkpoint_dir: Path | None, run_dir: Path) -> Path | None:
    """The checkpoint trainer.resume names, as the trainer finds it (None:
    none is found; the trainer says why). Quietly: the trainer finds it
    again and warns once (a damaged latest.json) where it loads it."""
    import io

    from recsys_cli.train import restore

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return restore.locate_resume(resume, checkpoint_dir or run_dir / "checkpoints", run_dir)
    except UserError:
        return None


def hydra_files(cfg: DictConfig) -> dict[str, str]:
    """The three files Hydra writes into .hydra/ (config, hydra, overrides),
    as text: taken while Hydra's config is at hand, written by
    save_hydra_config once the run is set up (also in a spawned worker)."""
    hydra_cfg = OmegaConf.to_container(HydraConfig.get(), resolve=False)
    assert isinstance(hydra_cfg, dict), "Hydra's config is a mapping"
    hydra_cfg["output_subdir"] = _output_subdir
    return {name: OmegaConf.to_yaml(node) for name, node in (
        ("config.yaml", cfg), ("hydra.yaml", {"hydra": hydra_cfg}), ("overrides.yaml", HydraConfig.get().overrides.task))}


def save_hydra_config(files: dict[str, str], directory: Path) -> None:
    """`files` (hydra_files) into `directory`, each renamed into place: a
    resume on several ranks reads overrides.yaml while rank 0 rewrites it
    (resume_overrides.py)."""
    for name, text in files.items():
        tmp = directory / f".{name}.tmp-{os.getpid()}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, directory / name)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise write_error(directory / name, e) from None


def _train(cfg: DictConfig, run_dir: Path, record: Callable[[], None] | None = None) -> float | None:
    """Train; `record` (the run's .hydra/ files) is written once the Trainer
    is set up, i.e. a resume was accepted (distributed_app: by rank 0)."""
    from recsys_cli.train.progress import summary_table
    from recsys_cli.train.trainer import Trainer

    from recsys_cli.train import distributed

    console = Console()
    if cfg.trainer.nproc > 1 or distributed.launched_by_agent():  # several processes (torchrun, or spawned here)
        from recsys_cli.train.distributed_app import train_app

        return train_app(cfg, run_dir, record)
    trainer = Trainer(cfg, run_dir=run_dir, console=console)
    if record is not None:
        record()
    summary = trainer.fit()
    console.print(summary_table(summary))
    say(console, f"run directory: {run_dir}", soft_wrap=True)
    val = summary["final"].get("val")
    return None if val is None else val["auc"]


def check_overrides(overrides: list[str]) -> DictConfig | None:
    """Compose the config once before Hydra does, so that a bad override is
    a one-line UserError (exit 2) instead of Hydra's report (exit 1).
    hydra.* overrides are left to Hydra; with flags other than -m (--help,
    --cfg ...) nothing is checked here. With -m, a sweep (a,b, range(),
    choice(), glob()) is expanded into its jobs as Hydra's basic sweeper
    expands it, and every job is composed and checked before the first one
    starts (the error names the job and its sweep values); the first job's
    config is returned. A sweep without -m is a one-line error."""
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    multirun = any(o in ("-m", "--multirun") for o in overrides)
    plain = [o for o in overrides if o not in ("-m", "--multirun")]
    if any(o.startswith("-") for o in plain):
        return None
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        try:  # the config loader: glob() lists a group's options
            parsed = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader()).parse_overrides(plain)
            keep = [o for o in parsed  # input_line: None only for overrides made in code, not parsed
                    if o.input_line is not None and not o.key_or_group.startswith("hydra")]
            sweeps = [o for o in keep if o.is_sweep_override()]
            if sweeps and not multirun:  # Hydra's "Ambiguous value" report is five lines, exit 1
                raise UserError(f"{sweeps[0].input_line} is a sweep: run it with -m (recsys train -m ...), "
                                "or quote a comma that belongs to the value (key='a,b')")
            if not (multirun and sweeps):
                return _checked([o.input_line for o in keep if o.input_line is not None and not o.is_sweep_override()])
            jobs = BasicSweeper.split_arguments(keep, None)[0]
        except (HydraException, OmegaConfBaseException, ValueError) as e:
            raise _bad_configuration(e) from None
        swept = {o.get_key_element() for o in sweeps}
        first = None
        for number, job in enumerate(jobs):
            try:
                cfg = _checked(job)
            except UserError as e:
                values = " ".join(o for o in job if o.partition("=")[0] in swept)
                raise UserError(f"{e} (job #{number} of the sweep: {values})") from None
            first = first if first is not None else cfg
        return first


def _checked(overrides: list[str]) -> DictConfig:
    """configs/train.yaml composed with `overrides` (no sweep, no hydra.*)
    against the schema, in initialize_config_dir's context: a misspelt key,
    a bad value or range is a one-line UserError."""
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from recsys_cli.config import TrainConfig, validate

    try:
        cfg = compose(config_name="train", overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise _bad_configuration(e) from None
    extra = _unknown_keys(cfg, OmegaConf.structured(TrainConfig))  # `+key=value` gets past compose
    if extra:
        raise UserError(f"bad configuration: unknown key '{extra[0]}'")
    validate(cfg)  # ranges and combinations too, before torch is imported (the Trainer checks again)
    return cfg


def _bad_configuration(e: BaseException) -> UserError:
    """A composition error `e` as the one line `bad configuration: ...` (compose_errors.one_line)."""
    from recsys_cli.compose_errors import one_line

    message = one_line(e)
    if "'placement.overrides." in message:  # a free-form dict: new keys need a +
        message += " (a table's placement is added with +placement.overrides.TABLE=KIND)"
    if "'precision/" in message:  # Lightning's precision=bf16 is the dense half's here
        message += (" (precision= is how the embedding tables are stored; the dense model's bf16 autocast "
                    "is model.dense_precision=bf16)")
    return UserError(f"bad configuration: {message}")


def train_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The config `recsys train OVERRIDES` runs (public API, recsys_cli.train_config):
    configs/train.yaml with the overrides (group=option, key=value; the older
    `+group=option` too) composed against the schema and checked as the
    command checks it, for Trainer(cfg, run_dir=...). A misspelt key, a bad
    value or a sweep is a UserError naming it."""
    given = group_overrides(list(overrides))
    odd = next((o for o in given if o.startswith("-") or o.lstrip("+").startswith("hydra.")), None)
    if odd is not None:
        raise UserError(f"train_config takes group=option and key=value overrides, not {odd!r}")
    register_configs()
    cfg = check_overrides(given)
    assert cfg is not None  # no flags: check_overrides composed it
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeps = [o.input_line for o in OverridesParser.create().parse_overrides(given) if o.is_sweep_override()]
    if sweeps:
        raise UserError(f"train_config composes one run: {sweeps[0]!r} is a sweep (recsys train -m)")
    return cfg


def _naming_saved_overrides(error: UserError, restored) -> UserError:
    """A resume's configuration error that the overrides it took from the
    resumed run cause (the command line alone composes) names the file they
    came from: 'unknown key' alone did not say it was in .hydra/overrides.yaml."""
    if restored.source is None or not restored.taken:
        return error
    try:
        check_overrides(restored.overrides[len(restored.taken):])
    except UserError:
        return error  # the command line's own
    return UserError(f"{error} (in the overrides the resume took from {restored.source})")


def check_places(overrides: list[str], cfg: DictConfig | None) -> None:
    """Before Hydra makes the run directory (a read-only one was Hydra's
    traceback): the run (or sweep) directory and the checkpoint directory can
    be written, else one line naming the path (locks.check_writable)."""
    from recsys_cli import locks

    if cfg is None:  # --help, --cfg ...: nothing will be written
        return
    multirun = any(o in ("-m", "--multirun") for o in overrides)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    value = next((o.split("=", 1)[1] for o in reversed(overrides) if o.lstrip("+").startswith(key + "=")), None)
    if value and "${" in value:  # an interpolation (a date, a job number): the part before it exists as written
        prefix = value[: value.index("${")]
        value = prefix if prefix.endswith("/") else str(Path(prefix).parent) if prefix else None
    run_dir = Path(value) if value else Path.cwd() / ("multirun" if multirun else "outputs")
    locks.check_writable(run_dir, "sweep directory" if multirun else "run directory")
    if cfg is not None and cfg.trainer.checkpoint_dir:
        locks.check_writable(Path(cfg.trainer.checkpoint_dir), "checkpoint directory")


def _unknown_keys(node, schema, prefix: str = "") -> list[str]:
    """Keys of `node` that the structured schema does not have (its free-form
    dict fields, like placement.overrides, take any key)."""
    from omegaconf import DictConfig

    if not isinstance(node, DictConfig) or not isinstance(schema, DictConfig) or OmegaConf.get_type(schema) is dict:
        return []
    out = []
    for key in map(str, node.keys()):  # a structured schema's keys are strings
        if key not in schema:
            out.append(f"{prefix}{key}")
        else:
            out += _unknown_keys(node[key], schema[key], f"{prefix}{key}.")
    return out


PURPOSE = """Train a DLRM on the built-in synthetic data or a preprocessed dataset (dataset.path=DIR), its
embedding tables placed by placement= and stored at precision=. Writes a run directory
(outputs/DATE/TIME, or hydra.run.dir=DIR: metrics.jsonl, checkpoints/, summary.json) and prints the
end-of-run table. Arguments are Hydra overrides: group=option picks configs/GROUP/OPTION.yaml,
key=value sets a key, -m sweeps comma-separated values (recsys train -m optimizer.lr=0.05,0.1).
The defaults below are the schema's, with the options and overrides given before --help applied."""

EXAMPLES = ("recsys train trainer.max_steps=200 dataset.synthetic.rows=20000",
            "recsys train placement=lookahead precision=int8 optimizer=adagrad trainer.batch_size=512")


def train_help(overrides: list[str]) -> str:
    """`recsys train [overrides] --help`: the config groups and their
    options, then every key with its default (as composed with `overrides`)
    and its description from the schema (options.help_text, as every command)."""
    from recsys_cli.config import TrainConfig
    from recsys_cli.options import help_text

    rest = [o for o in overrides if o not in ("-h", "--help", "-m", "--multirun")]
    cfg = check_overrides(rest)
    defaults = OmegaConf.load(Path(CONFIG_DIR) / "train.yaml").defaults
    chosen = {str(k): str(v) for d in defaults if isinstance(d, DictConfig) for k, v in d.items()}
    groups = ["groups (group=option; * the default):"]
    for group in sorted(chosen):
        options = sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))
        groups.append(f"  {group}: " + ", ".join(f"{o}*" if o == chosen[group] else o for o in options))
    groups.append("Hydra's own flags (--cfg job, --hydra-help, --info) still work.")
    return help_text("train", PURPOSE, EXAMPLES, schema=TrainConfig, values=cfg,
                     usage="recsys train [-m] [group=option ...] [key=value ...]", extra="\n".join(groups))


def hydra_argv(args: list[str]) -> list[str]:
    """The command line for Hydra's app: `args` (overrides and Hydra's own
    flags) with hydra.output_subdir=null (the app writes .hydra/ itself)
    beside the last override, else first. argparse takes the overrides as
    one run between flags (`trainer.max_steps=3 --cfg job` then a last
    override was "unrecognized"), and --info's optional value would take
    one placed at the end (`recsys train --info` was "invalid choice")."""
    from hydra._internal.utils import get_args_parser

    nargs = {flag: action.nargs for action in get_args_parser()._actions for flag in action.option_strings}
    at = i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if not arg.startswith("-"):
            at = i  # after this override
        elif "=" not in arg and (nargs.get(arg, 0) is None or (  # --cfg job: the flag's value is no override
                nargs.get(arg) == "?" and i < len(args) and not args[i].startswith("-"))):  # --info searchpath
            i += 1
    return [*args[:at], "hydra.output_subdir=null", *args[at:]]


def run_train_app(overrides: list[str]) -> None:
    overrides = group_overrides(overrides)  # +placement=x, the older spelling, is placement=x
    if any(o in ("-h", "--help") for o in overrides):  # ours, before Hydra's template (--hydra-help is Hydra's)
        register_configs()
        print(train_help(overrides))
        return
    register_configs()
    from recsys_cli.train.resume_overrides import say_restored, with_saved_overrides

    restored = with_saved_overrides(overrides, check_overrides)  # trainer.resume: the resumed run's overrides first
    say_restored(restored)
    overrides = restored.overrides
    try:
        cfg = check_overrides(overrides)
    except UserError as e:
        raise _naming_saved_overrides(e, restored) from None
    check_places(overrides, cfg)
    app = hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")(train_main)
    global _output_subdir
    from recsys_cli.train import distributed  # torch: after the config is known to be good

    overrides = distributed.follower_overrides(overrides)
    for o in overrides:
        if o.lstrip("+").startswith("hydra.output_subdir="):
            value = o.split("=", 1)[1]
            _output_subdir = None if value in ("null", "~", "") else value
    _existing.update(rundir.existing_dirs(overrides))
    sys.argv = ["recsys train", *hydra_argv(overrides)]
    try:
        app()
    except SystemExit as e:
        if e.code == 1 and not _started:  # Hydra rejected the command line (a hydra.* key, a sweep value)
            sys.exit(2)
        raise
