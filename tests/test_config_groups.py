"""`placement`, `precision` and `dedup` are groups of the defaults list: `group=option`
works as for any Hydra group, and the older `+group=option` still does, in single
runs and in sweeps (issue 28)."""

from __future__ import annotations

import json

import pytest
import yaml

from recsys_cli.config_groups import group_overrides
from commands import train_in_process

TINY = ["dataset.synthetic.rows=3000", "dataset.synthetic.cardinality_scale=0.0002", "trainer.max_steps=2",
        "trainer.progress=false", "trainer.final_checkpoint=false"]


@pytest.fixture
def train(tmp_path, capsys, monkeypatch):
    """`recsys train ARGS` in tmp_path, by main() in this process (commands.train_in_process):
    what the spellings compose to, not the process."""
    return lambda *args: train_in_process(list(args), cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)


def test_only_whole_groups_lose_their_plus():
    assert group_overrides(["+placement=lookahead", "++precision=int8", "+dedup=on", "+placement.overrides.C3=disk",
                            "+placement=device,lookahead", "placement=host", "+trainer.foo=1"]) == [
        "placement=lookahead", "precision=int8", "dedup=on", "+placement.overrides.C3=disk",
        "placement=device,lookahead", "placement=host", "+trainer.foo=1"]


@pytest.mark.parametrize("plus", ["", "+"])
def test_each_spelling_of_the_groups_composes_the_option(tmp_path, plus, train):
    result = train("--cfg", "job", f"{plus}placement=lookahead", f"{plus}precision=int8", f"{plus}dedup=on")
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout)
    assert (cfg["placement"]["kind"], cfg["placement"]["window"]) == ("lookahead", 4)  # lookahead.yaml applied
    assert cfg["precision"]["kind"] == "int8" and cfg["dedup"]["enabled"] is True


@pytest.mark.parametrize("plus", ["", "+"])
def test_each_spelling_sweeps_over_the_placements(tmp_path, plus, train):
    result = train("-m", f"{plus}placement=device,lookahead", *TINY, "hydra.sweep.dir=multi")
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = [json.loads((tmp_path / "multi" / str(job) / "summary.json").read_text())["placement"] for job in (0, 1)]
    assert kinds == ["device", "lookahead"]
