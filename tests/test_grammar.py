"""One command grammar (issue 42 item 4): every command takes key=value
options merged into a structured config, a misspelt key is one line naming
it (exit 2) for every command, one word means one thing across commands,
and each renamed spelling still works with one `deprecated:` line.
In-process (tests/commands.py): no command here starts Hydra's app."""

from __future__ import annotations

import dataclasses

import pytest

from commands import in_process, in_process_output


# --- a typo in a key, for every command ------------------------------------------------------------

TYPOS = [
    (["train", "trainer.bach_size=3"], "trainer.bach_size"),
    (["preprocess", "criteo", "input=a", "output=o", "min_cout=2"], "min_cout"),
    (["preprocess", "synthetic", "rowz=3"], "rowz"),
    (["predict", "chekpoint=x"], "chekpoint"),
    (["evaluate", "checkpoint=x", "splt=val"], "splt"),
    (["export", "checkpoint=x", "fromat=module"], "fromat"),
    (["report", "input=x", "plot=false"], "plot"),
    (["verify", "inptu=x"], "inptu"),
]


@pytest.mark.parametrize("argv,key", TYPOS, ids=lambda v: v[0] if isinstance(v, list) else None)
def test_a_misspelt_key_is_one_line_naming_it_exit_2(argv, key, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    code, err = in_process(argv, capsys)
    assert code == 2, err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert f"'{key}'" in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,needle", [
    (["predict", "checkpoint=x", "device=gpu"], "device='gpu' is not one of auto, cpu, cuda"),
    (["evaluate", "checkpoint=x", "convert=int3"], "convert='int3' is not one of fp32, fp16, int8, int4"),
    (["evaluate", "checkpoint=x", "bins=many"], "bins"),
    (["report", "input=x", "plots=maybe"], "plots"),
])
def test_a_bad_value_is_one_line_naming_the_key(argv, needle, capsys, monkeypatch):
    """predict/evaluate/export/report/verify validate through the same
    OmegaConf merge and the same words (compose_errors) as train."""
    monkeypatch.setenv("COLUMNS", "400")
    code, err = in_process(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


# --- one word, one meaning -------------------------------------------------------------------------

def command_schemas() -> dict[str, type]:
    from recsys_cli.evaluate import EvaluateConfig
    from recsys_cli.export import ExportConfig
    from recsys_cli.predict import PredictConfig
    from recsys_cli.preprocess import _SCHEMAS
    from recsys_cli.report import ReportConfig
    from recsys_cli.verify import VerifyConfig

    return {"preprocess criteo": _SCHEMAS["criteo"], "preprocess synthetic": _SCHEMAS["synthetic"],
            "predict": PredictConfig, "evaluate": EvaluateConfig, "export": ExportConfig, "report": ReportConfig,
            "verify": VerifyConfig}


def test_no_command_key_is_a_train_config_group():
    """`dataset=` picked a config group in train and was a path in evaluate;
    `precision=` stored train's tables and converted them in export: a
    train group's name is never another command's key."""
    import yaml

    from recsys_cli import config_dirs

    train_yaml = config_dirs.config_dir(config_dirs.TRAIN) / "train.yaml"
    groups = {k for d in yaml.safe_load(train_yaml.read_text())["defaults"] if isinstance(d, dict) for k in d}
    assert {"dataset", "precision", "placement"} <= groups
    clashes = [f"{command}: {f.name}=" for command, schema in command_schemas().items()
               for f in dataclasses.fields(schema) if f.name in groups]
    assert not clashes, clashes


def test_split_names_one_split_everywhere():
    """split= is the name of one split (predict, evaluate); preprocess's way
    of cutting rows is split_by=, its ratios split_ratios= as the synthetic data's."""
    schemas = command_schemas()
    have_split = sorted(c for c, s in schemas.items() if "split" in {f.name for f in dataclasses.fields(s)})
    assert have_split == ["evaluate", "predict"], have_split
    for command in ("preprocess criteo", "preprocess synthetic"):
        assert "split_ratios" in {f.name for f in dataclasses.fields(schemas[command])}, command


def test_shared_words_mean_one_thing():
    """Keys several commands share keep one meaning: input= is what the
    command reads, output= what it writes, convert= the tables' precision
    for scoring, device= auto|cpu|cuda."""
    from recsys_cli.options import field_help

    for command, schema in command_schemas().items():
        described = field_help(schema)
        names = {f.name for f in dataclasses.fields(schema)}
        if "input" in names:
            assert any(w in described["input"].lower() for w in ("read", "tsv", "directory", "dataset")), command
        if "convert" in names:
            assert "fp32" in described["convert"] and "int4" in described["convert"], command
        if "device" in names:
            assert "cpu" in described["device"] and "cuda" in described["device"], command
    assert {f.name for f in dataclasses.fields(command_schemas()["verify"])} == {"input"}
    assert {"input", "output", "plots"} == {f.name for f in dataclasses.fields(command_schemas()["report"])}


def test_lightnings_precision_bf16_points_to_dense_precision(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    code, err = in_process(["train", "precision=bf16"], capsys)
    assert code == 2 and "model.dense_precision=bf16" in err and len(err.strip().splitlines()) == 1, err


# --- renamed keys: the old spelling still works, with one line ------------------------------------

def parsed(command: str, schema: type, argv: list[str], capsys) -> tuple[object, str]:
    from recsys_cli.options import parse_options

    capsys.readouterr()
    cfg = parse_options(schema, argv, command, renamed_of(command))
    return cfg, capsys.readouterr().err


def renamed_of(command: str) -> tuple:
    from recsys_cli import evaluate
    from recsys_cli.options import CONVERT_RENAMED

    return {"evaluate": evaluate.RENAMED}.get(command, (CONVERT_RENAMED,))


@pytest.mark.parametrize("command,old,new", [
    ("evaluate", "dataset=data/x", "input=data/x"),
    ("evaluate", "precision=int8", "convert=int8"),
    ("predict", "precision=fp16", "convert=fp16"),
    ("export", "precision=int4", "convert=int4"),
])
def test_a_renamed_key_reads_as_the_new_one_with_one_deprecation_line(command, old, new, capsys):
    from recsys_cli.evaluate import EvaluateConfig
    from recsys_cli.export import ExportConfig
    from recsys_cli.predict import PredictConfig

    schema = {"evaluate": EvaluateConfig, "predict": PredictConfig, "export": ExportConfig}[command]
    base = ["checkpoint=run"]
    now, quiet = parsed(command, schema, [*base, new], capsys)
    before, said = parsed(command, schema, [*base, old], capsys)
    assert before == now and quiet == ""
    old_key, new_key = old.split("=")[0], new.split("=")[0]
    assert len(said.strip().splitlines()) == 1 and said.startswith("deprecated:"), said
    assert f"{old_key}=" in said and f"{new_key}=" in said, said


def test_preprocess_criteos_split_and_ratios_read_as_split_by_and_split_ratios(capsys):
    from recsys_cli.preprocess import load_config

    capsys.readouterr()
    now = load_config("criteo", ["input=a", "output=o", "split_by=ratios", "split_ratios=[0.5,0.25,0.25]"])
    assert capsys.readouterr().err == ""
    before = load_config("criteo", ["input=a", "output=o", "split=ratios", "ratios=[0.5,0.25,0.25]"])
    said = capsys.readouterr().err.strip().splitlines()
    assert before == now and now.split_by == "ratios" and now.split_ratios == [0.5, 0.25, 0.25]
    assert len(said) == 2 and all(s.startswith("deprecated:") for s in said), said
    assert "split_by=" in said[0] and "split_ratios=" in said[1], said


@pytest.mark.parametrize("old,new", [
    (["runs"], ["input=runs"]),
    (["runs", "--out", "rep"], ["input=runs", "output=rep"]),
    (["runs", "--out=rep", "--no-plots"], ["input=runs", "output=rep", "plots=false"]),
])
def test_reports_flags_and_positional_read_as_keys(old, new, capsys):
    from recsys_cli.options import old_arguments, parse_options
    from recsys_cli.report import ReportConfig

    capsys.readouterr()
    args = old_arguments(old, "report", "input", flags={"--out": "output"}, switches={"--no-plots": "plots=false"})
    said = capsys.readouterr().err.strip().splitlines()
    assert args == new
    assert parse_options(ReportConfig, args, "report") == parse_options(ReportConfig, new, "report")
    assert len(said) == len(old) - ("--out" in old) and all(s.startswith("deprecated:") for s in said), said


def test_verify_with_a_positional_or_input_checks_the_same_dataset(tmp_path, capsys, monkeypatch):
    """`recsys verify DIR` (the old spelling) and `recsys verify input=DIR`
    both check the dataset; the old one says once that it is deprecated, and a
    second positional is refused as not key=value."""
    from data_tools import synthetic

    monkeypatch.setenv("COLUMNS", "400")
    data = tmp_path / "data"
    synthetic.generate(synthetic.SyntheticConfig(rows=300, cardinality_scale=0.0005, row_group_rows=100), data,
                       progress=False)
    code, out, err = in_process_output(["verify", f"input={data}"], capsys)
    assert code == 0 and out.startswith(f"ok: {data}") and err == "", (out, err)
    code, out, err = in_process_output(["verify", str(data)], capsys)
    assert code == 0 and out.startswith(f"ok: {data}"), (out, err)
    assert err.startswith("deprecated:") and len(err.strip().splitlines()) == 1 and f"input={data}" in err, err
    code, err = in_process(["verify", str(data), str(tmp_path)], capsys)
    assert code == 2 and "key=value" in err and len(err.strip().splitlines()) == 2, err  # the deprecation, the error
    code, err = in_process(["verify"], capsys)
    assert code == 2 and "needs input=" in err, err
