"""`recsys COMMAND --help` (issue 42 item 4): every command answers -h and
--help with exit status 0, its purpose, its keys with their defaults and
descriptions (taken from the structured configs, options.help_text), and two
examples that run as written. In-process: no command here starts Hydra's app,
but for the real-process test that Hydra's own flags, which `recsys train
--help` names, still work."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from commands import RECSYS, in_process_output
from recsys_cli.options import field_help

COMMANDS = [["train"], ["preprocess"], ["preprocess", "criteo"], ["preprocess", "synthetic"], ["report"],
            ["predict"], ["evaluate"], ["export"], ["verify"]]


def schemas() -> dict[str, type]:
    from recsys_cli.config import TrainConfig
    from recsys_cli.evaluate import EvaluateConfig
    from recsys_cli.export import ExportConfig
    from recsys_cli.predict import PredictConfig
    from recsys_cli.preprocess import _SCHEMAS
    from recsys_cli.report import ReportConfig
    from recsys_cli.verify import VerifyConfig

    return {"train": TrainConfig, "preprocess criteo": _SCHEMAS["criteo"],
            "preprocess synthetic": _SCHEMAS["synthetic"], "predict": PredictConfig, "evaluate": EvaluateConfig,
            "export": ExportConfig, "report": ReportConfig, "verify": VerifyConfig}


def help_of(argv: list[str], capsys) -> str:
    code, out, err = in_process_output(argv, capsys)
    assert code == 0 and not err, (argv, code, err)
    return out


def examples(out: str) -> list[str]:
    return [line.strip() for line in out.split("\nexamples:\n")[1].splitlines() if line.strip()]


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command, flag, capsys):
    out = help_of([*command, flag], capsys)
    name = " ".join(command)
    assert out.startswith(f"usage: recsys {name}"), out[:200]
    assert "Powered by Hydra" not in out
    purpose = out.split("\n", 1)[1]
    for heading in ("\ngroups (", "\nkeys (", "\narguments:"):
        purpose = purpose.split(heading)[0]
    assert len(purpose.split()) >= 8, out[:300]  # a sentence or more of what the command is for
    found = examples(out)
    assert len(found) == 2 and all(e.startswith(f"recsys {name}") for e in found), found
    if name in schemas():  # every key of the schema, with its default and its description
        keys = out.split("\nkeys (", 1)[1]
        for key, description in field_help(schemas()[name]).items():
            assert description, f"{name}: {key} has no description in its schema"
            line = next((x for x in keys.splitlines() if x.strip().startswith(f"{key}=")), None)
            assert line is not None, f"{name} --help does not list {key}"
            at = keys.index(line)
            assert description.split()[0] in keys[at:at + len(line) + 120], (key, description)


def test_recsys_alone_prints_the_usage_and_fails(capsys):
    """No command is a usage error (exit 2, usage on stderr); --help is not."""
    code, out, err = in_process_output([], capsys)
    assert code == 2 and not out and err.startswith("usage: recsys COMMAND")
    assert help_of(["--help"], capsys).startswith("usage: recsys COMMAND")


def test_help_shows_the_defaults_users_get(capsys):
    """The composed defaults (the schema's, with the options given before
    --help), not a second copy of them."""
    out = help_of(["train", "--help"], capsys)
    assert "\n  trainer.batch_size=256\n" in out and "\n  trainer.checkpoint_every=1000\n" in out
    assert "\n  dataset.synthetic.rows=500000\n" in out and "\n  placement.kind=device\n" in out
    out = help_of(["train", "placement=lookahead", "optimizer=adagrad", "trainer.batch_size=64", "--help"], capsys)
    assert "\n  placement.kind=lookahead\n" in out and "\n  optimizer.lr=0.005\n" in out
    assert "\n  trainer.batch_size=64\n" in out
    groups = out.split("groups (")[1].split("\n\n")[0]
    assert "  placement: " in groups and "device*" in groups and "preprocess" not in groups
    out = help_of(["preprocess", "synthetic", "rows=7", "--help"], capsys)
    assert "\n  rows=7 " in out and "cardinality_scale=0.002" in out
    assert "\n  output=null " in help_of(["report", "--help"], capsys)


def test_help_examples_are_accepted(tmp_path, capsys):
    """Each example's arguments compose and validate as the command would
    take them (no work is done: the paths they name need not exist), in
    today's spellings (no deprecation line)."""
    from recsys_cli.evaluate import EXAMPLES as EVALUATE, EvaluateConfig
    from recsys_cli.export import EXAMPLES as EXPORT, ExportConfig
    from recsys_cli.options import parse_options
    from recsys_cli.predict import EXAMPLES as PREDICT, PredictConfig
    from recsys_cli.preprocess import EXAMPLES as PREPROCESS, load_config
    from recsys_cli.report import EXAMPLES as REPORT, ReportConfig
    from recsys_cli.train.app import EXAMPLES as TRAIN, check_overrides
    from recsys_cli.verify import EXAMPLES as VERIFY, VerifyConfig

    for example in TRAIN:
        assert check_overrides(shlex.split(example)[2:]) is not None
    for command, schema, found in (("predict", PredictConfig, PREDICT), ("evaluate", EvaluateConfig, EVALUATE),
                                   ("export", ExportConfig, EXPORT), ("report", ReportConfig, REPORT),
                                   ("verify", VerifyConfig, VERIFY)):
        for example in found:
            parse_options(schema, shlex.split(example)[2:], command)
    for source, found in PREPROCESS.items():
        for example in found:
            load_config(source, shlex.split(example)[3:])
    assert "deprecated" not in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--info"], ["-i"], ["--info", "searchpath"], ["--cfg", "job", "trainer.max_steps=3"],
                                  ["trainer.max_steps=3", "--cfg", "job"], ["--hydra-help"]], ids=" ".join)
def test_hydras_own_flags_still_work(tmp_path, args):
    """`recsys train --help` says --cfg job, --hydra-help and --info still
    work: each as Hydra answers it, exit 0, nothing written (the app's
    hydra.output_subdir=null was --info's value, and an "unrecognized"
    argument after the flags)."""
    env = {**os.environ, "RECSYS_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([RECSYS, "train", *args], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr[-2000:]
    if "job" in args:
        assert "\n  max_steps: 3\n" in r.stdout, r.stdout[-3000:]
    if args[0] in ("--info", "-i"):
        assert "Config search path" in r.stdout, r.stdout[-3000:]
    assert list(tmp_path.iterdir()) == []
