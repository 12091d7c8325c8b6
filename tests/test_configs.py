"""Tests of the configs themselves (as lightning-hydra-template's test_configs):
every YAML file under configs/ composes against the structured schema
(recsys_cli/config.py), passes `validate`, and trains a Trainer for one step
where it can (on small synthetic data); the `recsys train` commands of the
README and docs/ compose exactly as written; a typo or a bad choice in a YAML file
fails at composition, naming the key.
"""

from __future__ import annotations

import io
import itertools
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recsys_cli.config import CHOICES, PLACEMENTS, TrainConfig, register_configs, validate
from recsys_cli.errors import UserError

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def defaults_groups() -> set[str]:
    """Groups in train.yaml's defaults list (chosen with group=option)."""
    defaults = yaml.safe_load((CONFIGS / "train.yaml").read_text())["defaults"]
    return {next(iter(d)) for d in defaults if isinstance(d, dict)}


def group_options() -> list[tuple[str, str]]:
    return sorted((p.parent.name, p.stem) for p in CONFIGS.glob("*/*.yaml"))


def option_override(group: str, option: str) -> str:
    return f"{group}={option}"


def test_every_group_is_in_the_defaults_list():
    """So that `placement=lookahead` works as for any Hydra group (issue 28)."""
    assert defaults_groups() == {p.name for p in CONFIGS.iterdir() if p.is_dir()}


def flatten(node: dict, prefix: str) -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out


def compose_train(overrides: list[str], config_dir: Path = CONFIGS):
    """As `recsys train` composes: `+placement=x` (the older spelling) is `placement=x`."""
    from recsys_cli.config_groups import group_overrides

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name="train", overrides=group_overrides(overrides))


def test_every_yaml_file_is_tested():
    """The tests below are parametrized by the files on disk: none is missed,
    and the groups are the schema's."""
    schema = OmegaConf.structured(TrainConfig)
    assert {g for g, _ in group_options()} <= set(schema.keys())
    assert len(group_options()) == len(list(CONFIGS.rglob("*.yaml"))) - 1  # train.yaml is the root


@pytest.mark.parametrize("group, option", group_options())
def test_each_yaml_composes_against_the_schema_and_validates(group, option):
    cfg = compose_train([option_override(group, option)])
    assert OmegaConf.get_type(cfg) is TrainConfig  # composed onto the schema, not a free dict
    expected = yaml.safe_load((CONFIGS / group / f"{option}.yaml").read_text()) or {}
    for key, value in flatten(expected, group).items():  # every key of the file landed, with its value
        got = OmegaConf.select(cfg, key)
        assert (OmegaConf.to_container(got) if OmegaConf.is_config(got) else got) == value, (option, key)
    if group == "dataset" and option == "criteo_kaggle":  # needs dataset.path=DIR: nothing more to check here
        return
    validate(cfg)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """Overrides for small synthetic data in a cache of this module's own."""
    cache = tmp_path_factory.mktemp("configs-cache")
    return [f"dataset.cache_dir={cache}", "dataset.synthetic.rows=2000", "dataset.synthetic.split_ratios=[0.9,0.05,0.05]",
            "dataset.synthetic.cardinality_scale=0.0005", "trainer.batch_size=4",
            "trainer.eval_batch_size=1024", "trainer.max_steps=1", "trainer.progress=false", "trainer.device=cpu"]


@pytest.mark.parametrize("group, option", group_options())
def test_each_yaml_trains_one_step(group, option, small_data):
    from recsys_cli.train.trainer import Trainer

    if (group, option) == ("dataset", "criteo_kaggle"):  # a `recsys preprocess` directory is the user's to give
        with pytest.raises(UserError, match="dataset.path=DIR"):
            Trainer(compose_train([option_override(group, option), *small_data]))
        return
    cfg = compose_train([option_override(group, option), *small_data])
    trainer = Trainer(cfg)
    summary = trainer.fit()
    assert trainer.step == 1 and summary["steps"] == 1
    from rich.console import Console

    from recsys_cli.train.progress import summary_table

    Console(width=200, file=io.StringIO()).print(summary_table(summary))  # the end-of-run table renders
    assert 0 <= summary["final"]["val"]["auc"] <= 1
    if group in ("placement", "precision"):  # the file's choice is what ran
        assert summary[group] == cfg[group].kind


# --- the documented commands ---------------------------------------------------------------
def readme_train_commands() -> list[str]:
    """Every `recsys train ...` line of the code blocks of README.md and
    docs/ (tests/test_docs.py's reader: continuation lines joined, comments cut)."""
    from test_docs import PAGES, command_lines

    return [line for page in PAGES for line in command_lines(page.read_text()) if line.startswith("recsys train")]


def expand_sweeps(args: list[str]) -> list[list[str]]:
    """`-m key=a,b` as one override list per combination (compose takes no sweeps)."""
    args = [a for a in args if a not in ("-m", "--multirun")]
    choices = []
    for a in args:
        key, _, value = a.partition("=")
        swept = "," in value and not value.startswith(("[", "{", "'", '"'))
        choices.append([f"{key}={v}" for v in value.split(",")] if swept else [a])
    return [list(c) for c in itertools.product(*choices)]


def test_readme_lists_train_commands():
    commands = readme_train_commands()
    assert len(commands) >= 10 and any("placement=lookahead" in c for c in commands)


@pytest.mark.parametrize("command", readme_train_commands())
def test_readme_train_commands_compose_as_written(command, tmp_path):
    args = [a for a in shlex.split(command)[2:] if not a.startswith("hydra.")]
    args = [a.replace("=DIR", f"={tmp_path}") for a in args]
    for overrides in expand_sweeps(args):
        cfg = compose_train(overrides)
        validate(cfg)
        for o in overrides:
            group, _, option = o.lstrip("+").partition("=")
            if group in ("placement", "precision"):  # the file chosen is the file applied
                chosen = yaml.safe_load((CONFIGS / group / f"{option}.yaml").read_text()) or {}
                # the default option sets nothing: its kind is the schema's
                expected = chosen.get("kind", OmegaConf.structured(TrainConfig)[group].kind)
                assert cfg[group].kind == expected


# --- bad files fail at composition -----------------------------------------------------------
@pytest.fixture
def config_copy(tmp_path) -> Path:
    copy = tmp_path / "configs"
    shutil.copytree(CONFIGS, copy)
    return copy


@pytest.mark.parametrize("text, message", [
    ("kind: lookahead\npolcy: lru\n", "placement.polcy"),
    ("kind: lookahed\n", "placement.kind='lookahed' is not one of " + ", ".join(PLACEMENTS)),
    ("kind: cache\nwindow: four\n", "placement.window"),
])
def test_a_typo_in_a_yaml_file_fails_at_composition_naming_the_key(config_copy, text, message):
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from recsys_cli.compose_errors import one_line

    (config_copy / "placement" / "mine.yaml").write_text(text)
    with pytest.raises((HydraException, OmegaConfBaseException)) as e:
        compose_train(["+placement=mine"], config_copy)
    line = one_line(e.value)
    assert message in line and "\n" not in line


def test_every_closed_choice_is_an_enum_of_the_schema():
    """OmegaConf checks these fields itself; validate() lists the same words."""
    schema = OmegaConf.structured(TrainConfig)
    for key, choice in CHOICES.items():
        group, field = key.split(".")
        value = schema[group][field]
        assert isinstance(value, choice) and value == value.value  # a member that is its own word
        with pytest.raises(Exception, match="expected one of"):
            schema[group][field] = "no-such-choice"


@pytest.mark.parametrize("key", ["placement.window", "placement.disk_io_threads", "trainer.eval_batch_size"])
def test_counts_below_one_are_errors_naming_the_key(key):
    cfg = OmegaConf.structured(TrainConfig)
    OmegaConf.update(cfg, key, 0)
    with pytest.raises(UserError, match=rf"^{re.escape(key)} must be >= 1, got 0$"):
        validate(cfg)


# --- every number of the schema is checked -----------------------------------------------------
def numeric_keys(schema=TrainConfig, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, int | float | list) of every number the schema holds, nested groups included."""
    import dataclasses
    import typing

    keys = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint, key = hints[f.name], prefix + f.name
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
        if dataclasses.is_dataclass(base):
            keys += numeric_keys(base, key + ".")
        elif base in (int, float):
            keys.append((key, base))
        elif typing.get_origin(base) is list and typing.get_args(base)[0] in (int, float):
            keys.append((key, list))
    return keys


def bad_values(kind: type, key: str) -> list:
    if kind is list:
        return [[-1]]
    if kind is int:
        return [-1]  # no count, size, step or seed of the schema is negative
    finite = [float("nan"), -1.0]
    return finite if key.startswith("dataset.synthetic.") else [*finite, float("inf")]


NUMERIC_KEYS = numeric_keys()


def test_the_schema_walk_finds_the_numbers():
    keys = dict(NUMERIC_KEYS)
    assert keys["trainer.loader_queue_depth"] is int and keys["precision.cache_ratio"] is float
    assert keys["model.bottom_mlp"] is list and keys["dataset.synthetic.zipf_exponent"] is float
    assert len(keys) > 40


@pytest.mark.parametrize("key, kind", NUMERIC_KEYS, ids=[k for k, _ in NUMERIC_KEYS])
def test_every_numeric_key_refuses_a_bad_value_naming_the_key(key, kind):
    """A new number in the schema without a check fails here."""
    for value in bad_values(kind, key):
        cfg = OmegaConf.structured(TrainConfig)
        OmegaConf.update(cfg, key, value)
        with pytest.raises(UserError) as e:
            validate(cfg)
        named = key.rpartition(".")[2] if key.startswith("dataset.synthetic.") else key  # "synthetic config: rows ..."
        assert named in str(e.value), (key, value, str(e.value))


@pytest.mark.parametrize("key, value", [("trainer.loader_queue_depth", 0), ("precision.cache_ratio", 0.0),
                                        ("optimizer.lr", 0.0), ("optimizer.eps", 0.0), ("trainer.max_steps", 0),
                                        ("placement.host_cache_ratio", 1.5)])
def test_zero_and_out_of_range_values_are_refused(key, value):
    cfg = OmegaConf.structured(TrainConfig)
    OmegaConf.update(cfg, key, value)
    with pytest.raises(UserError, match=rf"^{re.escape(key)} must be "):
        validate(cfg)


def test_the_defaults_and_unset_optionals_pass():
    validate(OmegaConf.structured(TrainConfig))  # every Optional number defaults to None or a valid value


# --- a user's cache size is obeyed or refused, never replaced (issue 40, problem 4) ---------------------------------


@pytest.mark.parametrize("overrides, needle", [
    # the hostile case: trained with placement.cache_ratio's 5 % cache without a word
    (["placement=lookahead", "precision=int4", "precision.cache_ratio=0.01"],
     "precision.cache_ratio=0.01 would not be used: placement=lookahead puts every table behind its own fp32 cache, "
     "sized by placement.cache_ratio=0.05: for a cache of 0.01 of the rows give placement.cache_ratio=0.01"),
    (["placement=disk", "precision=int8", "precision.cache_ratio=0.2"], "placement=disk puts every table"),
    (["placement=auto", "placement.device_memory_budget=1MiB", "precision=int8", "precision.cache_ratio=0.2"],
     "placement=auto sizes every cache from placement.device_memory_budget"),
    (["precision.cache_ratio=0.2"], "fp32 tables (precision.kind=fp32) have none"),
])
def test_a_precision_cache_ratio_no_table_uses_is_refused(overrides, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        validate(compose_train(overrides))


@pytest.mark.parametrize("overrides", [
    ["placement=lookahead", "precision=int4"],  # the placement's cache, its own ratio
    ["placement=lookahead", "precision=int4", "placement.cache_ratio=0.01"],
    ["placement=device", "precision=int4", "precision.cache_ratio=0.02"],  # the table's own cache: obeyed
    ["placement=lookahead", "precision=int8", "precision.cache_ratio=0.2", "+placement.overrides.C1=host"],
])
def test_a_precision_cache_ratio_a_table_uses_passes(overrides):
    validate(compose_train(overrides))


def test_the_precision_cache_ratio_sizes_what_it_says(tmp_path):
    """Obeyed where a table has its own cache; refused where the tables turn
    out to sit behind the placement's cache (no table is small enough for
    placement.device_max_rows: known only once the vocabularies are)."""
    from train_config import config
    from recsys_cli.train.trainer import Trainer

    trainer = Trainer(config(tmp_path, trainer__max_steps=1, placement__kind="host", precision__kind="int4",
                             precision__cache_ratio=0.02))
    (group,) = trainer.embeddings.groups
    assert group.capacity == round(sum(trainer.data.vocab_sizes) * 0.02)
    with pytest.raises(UserError, match=re.escape("precision.cache_ratio=0.1 would not be used: placement=lookahead")):
        Trainer(config(tmp_path, trainer__max_steps=1, placement__kind="lookahead", placement__device_max_rows=0,
                       precision__kind="int8", precision__cache_ratio=0.1))


def default_options() -> dict[str, str]:
    """{group: option} of train.yaml's defaults list (what `recsys train` uses)."""
    defaults = yaml.safe_load((CONFIGS / "train.yaml").read_text())["defaults"]
    return {k: str(v) for d in defaults if isinstance(d, dict) for k, v in d.items()}


def schema_default(schema, key: str):
    value = OmegaConf.select(schema, key)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def test_every_default_is_defined_once_in_the_schema():
    """Issue 42 item 5: the schema (recsys_cli/config.py, data_tools'
    SyntheticConfig and CriteoConfig) holds every default. A YAML file sets
    only what its option changes, so no key of any YAML file under configs/
    or preprocess_configs/ may repeat the schema's value (a second definition
    that would drift from it), and the files `recsys train` and `recsys
    preprocess` compose by default set no key at all (config.py once said
    batch_size 128 where trainer/default.yaml said 256)."""
    from recsys_cli.preprocess import _SCHEMAS

    twice, by_default = [], []
    train_schema = OmegaConf.structured(TrainConfig)
    files = [(p, f"{p.parent.name}/{p.stem}", train_schema, p.parent.name) for p in CONFIGS.glob("*/*.yaml")]
    files += [(CONFIGS / "train.yaml", "train", train_schema, "")]
    files += [(p, f"preprocess_configs/{p.stem}", OmegaConf.structured(_SCHEMAS[p.stem]), "")
              for p in (REPO / "preprocess_configs").glob("*.yaml")]
    for path, name, schema, group in files:
        values = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k not in ("defaults", "hydra")}
        for key, value in (flatten(values, group) if group else flatten(values, "")).items():
            key = key.lstrip(".")
            if not group or default_options().get(group) == path.stem:
                by_default.append(f"{name}: {key}={value!r}")
            elif value == schema_default(schema, key):
                twice.append(f"{name}: {key}={value!r}")
    assert not twice, f"YAML values equal to the schema's default (defined twice): {twice}"
    assert not by_default, f"default options that set values (the schema's default is the one): {by_default}"
