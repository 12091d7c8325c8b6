"""`recsys preprocess SOURCE key=value ...`: build a dataset directory.

Sources: `criteo` (raw Criteo TSV -> shards, data_tools.criteo) and
`synthetic` (data_tools.synthetic). Options are composed with Hydra from
preprocess_configs/<source>.yaml checked against the structured configs
registered below, so a misspelt key or a value of the wrong type fails
before any work, naming the key.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from data_tools.criteo import CriteoConfig
from data_tools.synthetic import SyntheticConfig
from recsys_cli import config_dirs
from recsys_cli.errors import UserError, say
from recsys_cli.locks import locked_output
from recsys_cli.options import Renamed, apply_renames

# Not under configs/: everything there is a config group of `recsys train`.
# The repository's preprocess_configs/, as installed with the package (config_dirs.py).
CONFIG_DIR = config_dirs.config_dir(config_dirs.PREPROCESS)
SOURCES = ("criteo", "synthetic")


@dataclass
class SyntheticPreprocessConfig(SyntheticConfig):
    # format=parquet: the dataset directory to write; format=tsv: the TSV file
    # (gzip'd when it ends in .gz), input for `recsys preprocess criteo`.
    output: Optional[str] = None
    format: str = "parquet"  # parquet | tsv
    # format=tsv: 0 writes one file; N >= 1 writes Criteo Terabyte's layout,
    # output=DIR holding day_0 .. day_<N-1>, the rows cut into N equal days in order.
    days: int = 0
    gz: bool = False  # format=tsv days=N: gzip each day file (day_N.gz)
    progress: bool = True  # a progress bar on a terminal


_SCHEMAS = {"criteo": CriteoConfig, "synthetic": SyntheticPreprocessConfig}
_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, node in _SCHEMAS.items():
        cs.store(name=f"{name}_schema", node=node)
    _registered = True


def _known(source: str) -> str:
    return ", ".join(f.name for f in fields(_SCHEMAS[source]))


def _error_message(source: str, e: BaseException) -> str:
    """A one-line reason from a Hydra/OmegaConf composition error."""
    from recsys_cli.compose_errors import one_line

    return one_line(
        e, lambda key: f"unknown option '{key}' for `recsys preprocess {source}` (options: {_known(source)})"
    )


# Old spellings (issue 42 item 4): split= names one split in predict and evaluate;
# split_ratios is the synthetic data's word (and dataset.synthetic.split_ratios in train).
RENAMED = {"criteo": (Renamed("split", "split_by", "split= names one split in `recsys predict` and `recsys evaluate`"),
                      Renamed("ratios", "split_ratios", "the word of `recsys preprocess synthetic` and "
                                                        "dataset.synthetic.split_ratios"))}


def compose(source: str, overrides: list[str]):
    """The composed, checked config of `source` as an OmegaConf node."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if source not in SOURCES:
        raise UserError(f"unknown preprocess source {source!r}; choose one of: {', '.join(SOURCES)}")
    overrides = apply_renames(overrides, RENAMED.get(source, ()), f"preprocess {source}")
    _register()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return hydra_compose(config_name=source, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise UserError(_error_message(source, e)) from None


def load_config(source: str, overrides: list[str]):
    """The config object (CriteoConfig or SyntheticPreprocessConfig)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = compose(source, overrides)
    known = {f.name for f in fields(_SCHEMAS[source])}
    extra = [k for k in cfg.keys() if k not in known]  # `+key=value` gets past Hydra
    if extra:
        raise UserError(f"unknown option '{extra[0]}' for `recsys preprocess {source}` (options: {_known(source)})")
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise UserError(_error_message(source, e)) from None


PURPOSE = {
    "criteo": "Raw Criteo TSV (Kaggle train.txt, Terabyte day_*; plain or .gz) -> a dataset directory of parquet "
              "shards and manifest.json, for `recsys train dataset.path=DIR` (vocabulary or hashing mode).",
    "synthetic": "Synthetic Criteo-like data: format=parquet writes a dataset directory (by default the data of "
                 "`recsys train`'s built-in dataset); format=tsv writes one raw Criteo TSV file (gzip'd when "
                 "output ends in .gz) for `recsys preprocess criteo`.",
}
EXAMPLES = {
    "criteo": ("recsys preprocess criteo input=train.txt output=data/kaggle",
               "recsys preprocess criteo input=test.txt output=data/kaggle-test vocab=data/kaggle labels=false"),
    "synthetic": ("recsys preprocess synthetic output=data/synthetic",
                  "recsys preprocess synthetic profile=terabyte cardinality_scale=1 rows=2400000 days=24 gz=true "
                  "format=tsv output=raw-days"),
}


def preprocess_help() -> str:
    """`recsys preprocess --help`: the sources; each has its own --help."""
    from recsys_cli.options import help_text

    return help_text("preprocess", "Build a dataset directory. `recsys preprocess SOURCE --help` lists the "
                     "source's keys, their defaults and what they mean.", (EXAMPLES["criteo"][0],
                                                                           EXAMPLES["synthetic"][0]),
                     entries=[(name, PURPOSE[name]) for name in SOURCES],
                     usage="recsys preprocess criteo|synthetic key=value ...")


def run_preprocess(source: str, overrides: list[str]) -> None:
    from recsys_cli.options import help_text, wants_help

    if wants_help(overrides):  # the defaults as composed with the other overrides given
        rest = [o for o in overrides if o not in ("-h", "--help")]
        print(help_text(f"preprocess {source}", PURPOSE[source], EXAMPLES[source], schema=_SCHEMAS[source],
                        values=compose(source, rest)))
        return
    cfg = load_config(source, overrides)
    if source == "criteo" and cfg.memory_budget is not None:  # "4GiB" -> bytes, before any work
        from recsys_cli.embeddings.placement_bytes import parse_bytes

        cfg.memory_budget = parse_bytes(cfg.memory_budget, "memory_budget")
    # One writer per output (locks.py): a second preprocess into the same
    # output is refused, naming the first, before any work.
    with locked_output(Path(cfg.output), "output", "preprocess") if cfg.output else contextlib.nullcontext():
        if source == "criteo":
            from data_tools.criteo import preprocess

            preprocess(cfg)
        else:
            _synthetic(cfg)


def _synthetic(cfg: SyntheticPreprocessConfig) -> None:
    import dataclasses

    from rich.console import Console

    from data_tools import synthetic

    if not cfg.output:
        raise UserError("output=DIR is required (output=FILE with format=tsv)")
    if cfg.format not in ("parquet", "tsv"):
        raise UserError(f"format must be parquet or tsv, got {cfg.format!r}")
    syn = SyntheticConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(SyntheticConfig)})
    console = Console(stderr=True, highlight=False)
    t = time.perf_counter()
    if cfg.format != "tsv" and (cfg.days or cfg.gz):
        raise UserError("days and gz apply to format=tsv only")
    if cfg.days < 0:
        raise UserError(f"days must be >= 0 (0: one file), got {cfg.days}")
    if cfg.format == "tsv" and cfg.days:
        paths = synthetic.write_tsv_days(syn, Path(cfg.output), cfg.days, gz=cfg.gz, progress=cfg.progress)
        dt = time.perf_counter() - t
        say(console, f"{syn.rows:,} rows of raw Criteo TSV in {len(paths)} day files in {dt:.1f} s: "
                     f"{paths[0].parent}/{paths[0].name} .. {paths[-1].name}", "synthetic:")
        return
    if cfg.format == "tsv":
        if cfg.gz:
            raise UserError("gz applies to days=N; for one file, end output with .gz")
        path = synthetic.write_tsv(syn, Path(cfg.output), progress=cfg.progress)
        dt = time.perf_counter() - t
        say(console, f"{syn.rows:,} rows of raw Criteo TSV in {dt:.1f} s: {path}", "synthetic:")
        return
    m = synthetic.generate(syn, Path(cfg.output), progress=cfg.progress)
    dt = time.perf_counter() - t
    splits = ", ".join(f"{k} {v.rows:,}" for k, v in m.splits.items())
    hidden = m.options.get("hidden_model", {})
    auc = hidden.get("val_auc")
    say(
        console, f"{syn.rows:,} rows ({splits}) in {dt:.1f} s, {syn.rows / max(dt, 1e-9):,.0f} rows/s; "
        f"click rate {hidden.get('click_rate', float('nan')):.3f}"
        + (f", hidden-model val AUC {auc:.3f}" if auc is not None else ""), "synthetic:",
    )
    say(console, "vocabulary: " + " ".join(f"{f.name}={f.vocab_size:,}" for f in m.sparse_features))
    say(console, f"wrote {Path(cfg.output)}")
