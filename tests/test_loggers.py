"""trainer.logger=tensorboard: the metrics.jsonl scalars as TensorBoard events,
and a clear message when tensorboard is not installed."""

from __future__ import annotations

import json
import sys

import pytest
from test_criteo_preprocess import make_rows, write_raw
from train_config import config

from data_tools.criteo import CriteoConfig, preprocess
from recsys_cli.errors import UserError
from recsys_cli.train.loggers import MISSING
from recsys_cli.train.trainer import Trainer


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tb")
    preprocess(CriteoConfig(input=str(write_raw(tmp / "t.txt", make_rows(1500, seed=4))), output=str(tmp / "data"),
                            split_by="ratios", progress=False))
    return tmp / "data"


def run_config(dataset, tmp_path, **kw):
    return config(tmp_path / "cache", dataset__path=str(dataset), trainer__max_steps=20, trainer__batch_size=32,
                  trainer__log_every=5, trainer__eval_every=10, trainer__device="cpu", **kw)


def test_tensorboard_missing_is_a_clear_error(dataset, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when not installed
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError) as e:
        Trainer(run_config(dataset, tmp_path, trainer__logger="tensorboard"), run_dir=tmp_path / "run")
    assert str(e.value) == MISSING and "pip install tensorboard " in MISSING and "-e" not in MISSING
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tensorboard_events_hold_the_jsonl_scalars(dataset, tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    run.mkdir()
    Trainer(run_config(dataset, tmp_path, trainer__logger="tensorboard"), run_dir=run).fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]

    def series(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    steps = [r for r in records if "loss" in r and "split" not in r]
    assert series("train/loss") == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]
    assert series("train/samples_per_second") == [(r["step"], pytest.approx(r["samples_per_second"], rel=1e-6))
                                                   for r in steps]
    assert [s for s, _ in series("phase_seconds/backward")] == [r["step"] for r in steps]
    vals = [r for r in records if r.get("split") == "val"]
    assert series("val/auc") == [(r["step"], pytest.approx(r["auc"], rel=1e-6)) for r in vals] and len(vals) == 2
    assert "test/logloss" in tags


def test_jsonl_only_by_default(dataset, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    Trainer(run_config(dataset, tmp_path), run_dir=run).fit()
    assert (run / "metrics.jsonl").exists() and not (run / "tensorboard").exists()
