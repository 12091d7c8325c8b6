"""trainer.init_from: a new run on the next day's data from a checkpoint's
weights and optimizer state (not trainer.resume)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_criteo_preprocess import make_rows, write_raw
from train_config import config

from data_tools.criteo import CriteoConfig, preprocess
from recsys_cli.data.loader import ShardLoader
from recsys_cli.errors import UserError
from recsys_cli.inference import load_model
from recsys_cli.train import restore
from recsys_cli.train.trainer import Trainer

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("days")
    preprocess(CriteoConfig(input=str(write_raw(tmp / "day0.txt", make_rows(2000, seed=1))), output=str(tmp / "day0"),
                            split_by="ratios", progress=False))
    preprocess(CriteoConfig(input=str(write_raw(tmp / "day1.txt", make_rows(1500, seed=2))), output=str(tmp / "day1"),
                            vocab=str(tmp / "day0"), split_by="ratios", progress=False))
    cfg = config(tmp / "cache", dataset__path=str(tmp / "day0"), trainer__max_steps=30, trainer__batch_size=64,
                 trainer__checkpoint_dir=str(tmp / "run0"), trainer__device="cpu", optimizer__name="adagrad",
                 optimizer__lr=0.05)
    first = Trainer(cfg)
    first.fit()
    return tmp, first


def test_init_from_continues_with_the_same_weights(days):
    tmp, first = days
    cfg = config(tmp / "cache", dataset__path=str(tmp / "day1"), trainer__max_steps=5, trainer__batch_size=64,
                 trainer__device="cpu", optimizer__name="adagrad", optimizer__lr=0.01, trainer__seed=7,
                 trainer__init_from=str(tmp / "run0"))
    second = Trainer(cfg)
    assert second.step == 0 and second.epoch == 0 and second.samples == 0
    a, b = first.state_dict(), second.state_dict()
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for name, table in a["tables"].items():
        for k, v in table.items():
            assert v == b["tables"][name][k] if isinstance(v, str) else torch.equal(v, b["tables"][name][k]), (name, k)
    for pid, s in a["dense_optimizer"]["state"].items():
        assert torch.equal(s["sum"], b["dense_optimizer"]["state"][pid]["sum"])
    assert second.dense_optimizer.param_groups[0]["lr"] == 0.01  # the new run's hyperparameters
    # the new run's first step starts from the checkpoint's model on day 1's first batch
    loaded = load_model(tmp / "run0", device="cpu")
    batch = next(iter(ShardLoader(tmp / "day1", "train", 64, shuffle=True, seed=7, drop_last=True)))
    expect = F.binary_cross_entropy_with_logits(loaded.logits(batch), batch.labels).item()
    second.record_losses = True
    second.fit()
    assert second.step_losses[0] == pytest.approx(expect, rel=1e-6)
    assert second.step == 5


def test_init_from_errors(days, tmp_path):
    tmp, _ = days
    preprocess(CriteoConfig(input=str(write_raw(tmp_path / "o.txt", make_rows(800, seed=9))), output=str(tmp_path / "o"),
                            split_by="ratios", progress=False))
    base = dict(trainer__max_steps=2, trainer__batch_size=64, trainer__device="cpu", optimizer__name="adagrad")
    with pytest.raises(UserError, match="vocabulary mismatch"):
        Trainer(config(tmp / "cache", dataset__path=str(tmp_path / "o"), trainer__init_from=str(tmp / "run0"), **base))
    with pytest.raises(UserError, match="no checkpoint at"):
        Trainer(config(tmp / "cache", dataset__path=str(tmp / "day1"), trainer__init_from=str(tmp_path / "nope"), **base))
    with pytest.raises(UserError, match="give one of them"):
        Trainer(config(tmp / "cache", dataset__path=str(tmp / "day1"), trainer__init_from=str(tmp / "run0"),
                       trainer__resume=str(tmp / "run0"), **base))


def test_init_from_another_optimizers_checkpoint_is_refused(days, tmp_path):
    """An SGD checkpoint has no Adagrad state: init_from into an Adagrad run
    took it, and the first step failed with a traceback (KeyError: 'step')."""
    tmp, _ = days
    base = dict(dataset__path=str(tmp / "day0"), trainer__batch_size=64, trainer__device="cpu")
    Trainer(config(tmp / "cache", trainer__max_steps=2, trainer__checkpoint_dir=str(tmp_path / "sgd"),
                   optimizer__name="sgd", **base)).fit()
    with pytest.raises(UserError, match=r"does not fit optimizer.name=adagrad \(it was trained with optimizer.name=sgd"):
        Trainer(config(tmp / "cache", trainer__max_steps=2, trainer__init_from=str(tmp_path / "sgd"),
                       optimizer__name="adagrad", **base))


def test_init_from_another_model_names_the_parameter_that_does_not_fit(days):
    """The one line said only torch's header: "(Error(s) in loading state_dict for DLRM:)"."""
    tmp, _ = days
    with pytest.raises(UserError, match=r"its model does not fit this config's \(size mismatch for top\.0\.weight: "
                                        r"copying a param with shape torch.Size\(\[64, \d+\]\) from checkpoint"):
        Trainer(config(tmp / "cache", dataset__path=str(tmp / "day1"), trainer__max_steps=2, trainer__batch_size=64,
                       trainer__device="cpu", optimizer__name="adagrad", model__interaction="cat",
                       trainer__init_from=str(tmp / "run0")))


def test_a_preempted_init_from_run_says_how_to_continue_it(days, tmp_path, monkeypatch):
    """The preemption line said "continue with trainer.resume=true (same
    overrides)": the same overrides hold trainer.init_from, and with it the
    resume was refused ("give one of them")."""
    from recsys_cli.train.preemption import Preempted

    tmp, _ = days
    base = dict(dataset__path=str(tmp / "day1"), trainer__max_steps=6, trainer__batch_size=64, trainer__device="cpu",
                optimizer__name="adagrad")
    monkeypatch.setattr(Trainer, "sigterm_received", lambda self: self.step >= 2)
    with pytest.raises(Preempted, match=r"continue with trainer.resume=true \(same overrides but trainer.init_from\)$"):
        Trainer(config(tmp / "cache", trainer__init_from=str(tmp / "run0"), **base), run_dir=tmp_path / "run").fit()
    with pytest.raises(UserError, match="continues with trainer.resume alone"):
        Trainer(config(tmp / "cache", trainer__init_from=str(tmp / "run0"), trainer__resume="true", **base),
                run_dir=tmp_path / "run")
    monkeypatch.undo()
    resumed = Trainer(config(tmp / "cache", trainer__resume="true", **base), run_dir=tmp_path / "run")
    assert resumed.step == 2


def test_resume_returns_the_position_it_restores(days):
    """restore.resume loads the modules it is given and returns where the run
    continues: the trainer's own counters change only when it applies them."""
    tmp, first = days
    cfg = config(tmp / "cache", dataset__path=str(tmp / "day0"), trainer__max_steps=30, trainer__batch_size=64,
                 trainer__device="cpu", optimizer__name="adagrad", optimizer__lr=0.05)
    fresh = Trainer(cfg)
    path = restore.resume_path(str(tmp / "run0"), None, None)
    at = restore.resume(path, fresh.cfg, fresh.data, fresh.restorable())
    assert (at.step, at.epoch, at.batch_in_epoch, at.samples) == (first.step, first.epoch, first.batch_in_epoch, first.samples)
    training_lines = [line for line in first.log.lines if '"split"' not in line]  # saved before the final evaluation
    assert at.metrics == training_lines and at.running_steps == first.running_steps
    assert (fresh.step, fresh.samples, fresh.saved_step) == (0, 0, None)  # nothing written behind the trainer's back
    for k, v in first.model.state_dict().items():
        assert torch.equal(v, fresh.model.state_dict()[k]), k
