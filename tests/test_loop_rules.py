"""The loop features of Lightning and dlrm (train/loop_control.py): validation
at every epoch's end, the best checkpoint and the last k, early stopping, the
AUC-threshold stop, and trainer.drop_last both ways, resumed bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from recsys_cli.errors import UserError
from recsys_cli.train.loop_control import LoopControl
from recsys_cli.train.trainer import Trainer
from train_config import assert_states_equal, config, state_of, train

# 10 validations (125 steps an epoch); at lr 1 the val AUC and log loss are best at step 90, not at the end.
STEPS = dict(trainer__max_steps=100, trainer__eval_every=10, optimizer__lr=1.0)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("recsys-cache")


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory):
    """Every validation and every checkpoint of the run the rules act on."""
    ck = tmp_path_factory.mktemp("reference") / "ck"
    trainer = train(config(cache_dir, **STEPS, trainer__checkpoint_every=10, trainer__keep_last=100,
                           trainer__checkpoint_dir=str(ck)))
    return trainer, ck


def val_evals(trainer):
    return [(r["step"], r) for r in trainer.evals if r["split"] == "val"]


def checkpoint(path):
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("monitor, pick", [("auc", max), ("logloss", min)])
def test_keep_best_and_the_last_k(cache_dir, tmp_path, reference, monitor, pick):
    ref, ref_ck = reference
    ck = tmp_path / "ck"
    trainer = train(config(cache_dir, **STEPS, trainer__checkpoint_every=10, trainer__keep_last=1,
                           trainer__keep_best=True, trainer__monitor=monitor, trainer__checkpoint_dir=str(ck)))
    assert trainer.step_losses == ref.step_losses  # the rules change which files stay, not the run
    evals = val_evals(ref)
    best_step = pick(evals, key=lambda e: e[1][monitor])[0]  # first of equals: a tie is no improvement
    best = json.loads((ck / "best.json").read_text())
    assert best["step"] == best_step and best["metric"] == monitor and best["mode"] == ("max" if pick is max else "min")
    kept = sorted(p.name for p in ck.glob("step-*.pt"))
    assert best_step < 100 and kept == sorted({f"step-{s:08d}.pt" for s in (100, best_step)})  # earlier bests went
    # The kept best is the state at that step: the reference run's checkpoint of the same step.
    assert_states_equal(checkpoint(ck / best["file"]), checkpoint(ref_ck / best["file"]))


def test_last_k_alone_keeps_the_newest(cache_dir, tmp_path):
    ck = tmp_path / "ck"
    train(config(cache_dir, trainer__max_steps=50, trainer__checkpoint_every=10, trainer__keep_last=3,
                 trainer__checkpoint_dir=str(ck)))
    assert sorted(p.name for p in ck.glob("step-*.pt")) == [f"step-{s:08d}.pt" for s in (30, 40, 50)]
    assert not (ck / "best.json").exists()


def test_early_stopping_after_patience_validations_without_improvement(cache_dir, reference):
    ref, _ = reference
    # min_delta 1: no AUC can improve by 1, so only the first validation is an improvement.
    trainer = train(config(cache_dir, **STEPS, trainer__early_stop_patience=2, trainer__early_stop_min_delta=1.0))
    assert trainer.step == 30 and trainer.control.stopped["step"] == 30
    assert trainer.step_losses == ref.step_losses[:30]
    # the final val result is the stopping validation's, not a second evaluation of the same weights
    assert [(r["step"], r["split"]) for r in trainer.evals] == [(10, "val"), (20, "val"), (30, "val"), (30, "test")]


def test_early_stopping_counts_from_the_best_validation():
    control = LoopControl(config("/nonexistent", trainer__early_stop_patience=2, trainer__monitor="logloss").trainer)
    assert control.mode == "min"
    decisions = [control.after_validation(s, {"logloss": v, "auc": 0.5})
                 for s, v in ((1, 0.5), (2, 0.4), (3, 0.45), (4, 0.39), (5, 0.41), (6, 0.40))]
    assert [d.improved for d in decisions] == [True, True, False, True, False, False]
    assert [d.stop is not None for d in decisions] == [False] * 5 + [True]
    assert control.best == 0.39 and control.best_step == 4


def test_stop_at_auc_stops_at_the_first_validation_reaching_it(cache_dir, reference):
    ref, _ = reference
    evals = val_evals(ref)
    threshold = round(evals[4][1]["auc"] - 1e-4, 4)  # about the fifth validation's AUC
    first = next(step for step, r in evals if r["auc"] >= threshold)  # found another way: in the full run's record
    assert first < 100
    trainer = train(config(cache_dir, **STEPS, trainer__stop_at_auc=threshold))
    assert trainer.step == first
    assert trainer.step_losses == ref.step_losses[:first]
    assert "trainer.stop_at_auc" in trainer.control.stopped["reason"]


def test_validation_at_every_epochs_end_by_default(cache_dir):
    trainer = train(config(cache_dir, trainer__epochs=2, trainer__max_steps=None))
    assert [(r["step"], r["split"]) for r in trainer.evals] == [(125, "val"), (250, "val"), (250, "test")]
    off = train(config(cache_dir, trainer__epochs=2, trainer__max_steps=None, trainer__eval_each_epoch=False))
    assert [(r["step"], r["split"]) for r in off.evals] == [(250, "val"), (250, "test")]
    assert off.step_losses == trainer.step_losses


def test_rules_without_validations_to_act_on_are_errors(cache_dir):
    with pytest.raises(UserError, match="trainer.early_stop_patience stops on a validation during the run"):
        Trainer(config(cache_dir, trainer__max_steps=20, trainer__early_stop_patience=2))


def test_eval_every_without_a_val_split_is_an_error(tmp_path):
    """A dataset without val rows (split_ratios=[1,0,0]): trainer.eval_every was
    ignored without a word, the run ending with no validation at all."""
    with pytest.raises(UserError, match=r"^trainer.eval_every=5 validates on the val split, but .* has no val rows"):
        Trainer(config(tmp_path, trainer__max_steps=20, trainer__eval_every=5, dataset__synthetic__rows=2000,
                       dataset__synthetic__split_ratios=[1.0, 0.0, 0.0]))


# --- drop_last -------------------------------------------------------------------------------
# 16,000 train rows at batch 96: 166 whole batches and 64 rows left.
DROP = dict(trainer__batch_size=96, trainer__epochs=2, trainer__max_steps=None, trainer__log_every=50)


@pytest.fixture(scope="module")
def dropped(cache_dir):
    console = Console(record=True, width=200, force_terminal=False)
    trainer = Trainer(config(cache_dir, **DROP), console=console)
    trainer.record_losses = True
    trainer.fit()
    return trainer, console.export_text()


def test_drop_last_true_says_so_and_drops_the_partial_batch(dropped):
    trainer, text = dropped
    assert trainer.step == 2 * 166 and trainer.samples == 2 * 166 * 96
    assert "trainer.drop_last=true: each epoch leaves out its last 64 of 16,000 train rows" in text


def test_drop_last_false_trains_the_partial_batch_and_resumes_exactly(cache_dir, tmp_path, dropped):
    dropped, _ = dropped
    kept = train(config(cache_dir, **DROP, trainer__drop_last=False))
    assert kept.step == 2 * 167 and kept.samples == 2 * 16_000
    # The whole batches are the same batches: the first 166 steps are dropped's, bit for bit.
    assert kept.step_losses[:166] == dropped.step_losses[:166]
    assert kept.step_losses[166] != dropped.step_losses[166]
    # Stopped just after the first partial batch, then resumed: the uninterrupted run.
    ck = str(tmp_path / "ck")
    part = train(config(cache_dir, **{**DROP, "trainer__max_steps": 170}, trainer__drop_last=False,
                        trainer__checkpoint_dir=ck))
    assert part.step == 170
    resumed = train(config(cache_dir, **DROP, trainer__drop_last=False, trainer__checkpoint_dir=ck,
                           trainer__resume="true"))
    assert resumed.step_losses == kept.step_losses[170:]
    assert_states_equal(state_of(resumed), state_of(kept))


def test_drop_last_false_with_several_processes_is_an_error():
    from recsys_cli.config import validate

    with pytest.raises(UserError, match="trainer.drop_last=false trains on the last partial batch in one process only"):
        validate(config("/nonexistent", trainer__drop_last=False, trainer__nproc=2))
