"""The library API (issue 42 item 7): `recsys_cli` exports what a program
needs to build a Trainer from a config, read a dataset and score an exported
model, lazily (`import recsys_cli` loads no torch), and every example of its
docstring runs as written."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap

import pytest

import recsys_cli
from commands import in_process_output

HEAVY = ("torch", "hydra", "omegaconf", "pyarrow", "numpy")


def test_import_recsys_cli_is_cheap():
    code = f"import sys, recsys_cli; print([m for m in {HEAVY!r} if m in sys.modules])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_every_public_name_resolves_and_nothing_else_is_offered():
    for name in recsys_cli.__all__:
        value = getattr(recsys_cli, name)
        assert value is not None and getattr(value, "__name__", name) == name, name
    assert [n for n in dir(recsys_cli) if not n.startswith("__")] == sorted(recsys_cli.__all__)
    with pytest.raises(AttributeError, match="no attribute 'checkpoint'"):
        recsys_cli.checkpoint  # noqa: B018  (internal modules are not part of the API)
    doc = recsys_cli.__doc__ or ""
    for name in recsys_cli.__all__:  # each public name is described in the reference the docstring is
        assert re.search(rf"^  {name}\b", doc, re.M), f"{name} is not described in recsys_cli's docstring"


def examples() -> list[tuple[list[str], str]]:
    """(the `recsys ...` commands the paragraph before it names, the code) of
    each example in the docstring: a paragraph ending in `::`, then its
    indented block."""
    lines = (recsys_cli.__doc__ or "").splitlines()
    found = []
    for i, line in enumerate(lines):
        if not line.endswith("::"):
            continue
        start = i
        while start > 0 and lines[start - 1].strip():
            start -= 1
        intro = " ".join(lines[start:i + 1])
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or lines[end].startswith("    ")):
            end += 1
        commands = re.findall(r"`(recsys [^`]+)`", intro)
        found.append((commands, textwrap.dedent("\n".join(lines[i + 1:end])).strip() + "\n"))
    return found


def test_the_docstrings_examples_run(tmp_path, monkeypatch, capsys):
    found = examples()
    assert len(found) == 3, found
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RECSYS_CACHE", str(tmp_path / "cache"))
    printed = []
    for commands, code in found:
        for command in commands:
            status, _, err = in_process_output(shlex.split(command)[1:], capsys)
            assert status == 0, (command, err)
        exec(compile(code, "<recsys_cli example>", "exec"), {})
        printed.append(capsys.readouterr().out)
    assert re.match(r"\{'train': \d+, 'val': \d+, 'test': \d+\}\n256 \(256, 13\) click rate 0\.\d{3}\n", printed[0]), \
        printed[0]
    assert re.search(r"val AUC 0\.\d{4} after 60 steps", printed[1]), printed[1]
    assert printed[2].startswith("int8\ntensor([") and printed[2].count(",") == 4, printed[2]  # 5 probabilities


def test_train_config_refuses_what_one_run_cannot_be():
    for overrides, needle in ((["trainer.bach_size=3"], "unknown key 'trainer.bach_size'"),
                              (["optimizer.lr=0.1,0.2"], "is a sweep"),
                              (["hydra.run.dir=x"], "not 'hydra.run.dir=x'")):
        with pytest.raises(recsys_cli.UserError, match=re.escape(needle)):
            recsys_cli.train_config(overrides)
    cfg = recsys_cli.train_config(["+placement=lookahead", "precision=int8"])  # the older group spelling too
    assert cfg.placement.kind == "lookahead" and cfg.precision.kind == "int8"
