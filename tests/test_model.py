"""DCNv2 cross layers, the learning-rate schedule, and both across placements,
precisions and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from recsys_cli.config import TrainConfig
from recsys_cli.errors import UserError
from recsys_cli.model.dlrm import LowRankCrossNet
from recsys_cli.train.schedule import LRSchedule
from recsys_cli.train.trainer import Trainer
from train_config import config, train

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)

DCN = dict(model__interaction="dcn", model__dcn_layers=2, model__dcn_rank=8, model__top_mlp=[32, 1])
SCHEDULE = dict(optimizer__schedule="warmup_poly", optimizer__warmup_steps=8, optimizer__decay_start_step=20,
                optimizer__decay_steps=15)
ADAGRAD = dict(optimizer__name="adagrad", optimizer__lr=0.05)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("recsys-cache")


def test_cross_net_computes_the_dcnv2_formula():
    torch.manual_seed(0)
    net = LowRankCrossNet(12, 3, 4)
    net.reset_parameters()
    for w in net.W:  # nonzero biases, so the test sees them
        torch.nn.init.normal_(w.bias)
    x0 = torch.randn(5, 12, dtype=torch.float64)
    net = net.double()
    x = x0
    for v, w in zip(net.V, net.W):  # x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l, one sample at a time
        x = torch.stack([x0[i] * (w.weight @ (v.weight @ x[i]) + w.bias) + x[i] for i in range(5)])
    torch.testing.assert_close(net(x0), x, rtol=1e-12, atol=1e-12)


def reference_lr(base, k, warmup, start, steps, power=2.0, floor=1e-7):
    """facebookresearch/dlrm's LRPolicyScheduler at step k (outside the gap
    between warmup and decay, where it holds the last warmup rate)."""
    if k < warmup:
        return base * (1.0 - (warmup - k) / warmup)
    if start <= k < start + steps:
        return max(floor, base * ((steps - (k - start)) / steps) ** power)
    return max(floor, base * (1 / steps) ** power) if k >= start + steps else base


def test_warmup_poly_follows_the_reference_scheduler():
    s = LRSchedule(2.0, "warmup_poly", warmup_steps=10, decay_start=10, decay_steps=30)
    for k in range(1, 60):
        assert s.lr(k) == pytest.approx(reference_lr(2.0, k, 10, 10, 30), rel=1e-12), k
    assert s.lr(1) == pytest.approx(0.2) and s.lr(10) == 2.0 and s.lr(39) == pytest.approx(2.0 / 900)
    assert LRSchedule(2.0).lr(5) == 2.0
    gap = LRSchedule(1.0, "warmup_poly", warmup_steps=4, decay_start=10, decay_steps=5)
    assert [gap.lr(k) for k in (4, 9)] == [1.0, 1.0] and gap.lr(10) == 1.0 and gap.lr(11) == pytest.approx(0.64)
    tiny = LRSchedule(1.0, "warmup_poly", decay_start=0, decay_steps=10_000)
    assert tiny.lr(9_999) == 1e-7  # the reference's floor


def test_unset_decay_runs_to_the_last_step(cache_dir):
    cfg = config(cache_dir, trainer__max_steps=40, optimizer__schedule="warmup_poly", optimizer__warmup_steps=5)
    s = Trainer(cfg).schedule
    assert (s.decay_start, s.decay_steps) == (5, 36)
    assert s.lr(5) == cfg.optimizer.lr and s.lr(40) == pytest.approx(cfg.optimizer.lr / 36**2)


def test_the_schedule_sets_the_rate_of_rows_and_dense_parameters(cache_dir):
    """One warmup step at lr 0.4 / 4 is one constant step at lr 0.1, bit for bit."""
    warm = train(config(cache_dir, trainer__max_steps=1, optimizer__lr=0.4, optimizer__schedule="warmup_poly",
                        optimizer__warmup_steps=4))
    flat = train(config(cache_dir, trainer__max_steps=1, optimizer__lr=0.1))
    for k, v in flat.model.state_dict().items():
        assert torch.equal(warm.model.state_dict()[k], v), k
    for name, t in flat.embeddings.table_state().items():
        assert torch.equal(warm.embeddings.table_state()[name]["weights"], t["weights"]), name
    assert warm.row_optimizer.lr == 0.1 and warm.dense_optimizer.param_groups[0]["lr"] == 0.1


def test_metrics_log_records_the_rate(cache_dir, tmp_path):
    train(config(cache_dir, trainer__max_steps=40, **SCHEDULE), run_dir=tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in records if "loss" in r}
    s = LRSchedule(0.1, "warmup_poly", 8, 20, 15)
    assert lrs == {k: pytest.approx(s.lr(k)) for k in (10, 20, 30, 40)}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["final"]["val"]) >= {"predicted_ctr", "observed_ctr", "calibration", "normalized_entropy"}
    train_ctr = summary["train_calibration"]
    assert train_ctr["samples"] == 40 * 128 and 0.15 < train_ctr["observed_ctr"] < 0.35


@pytest.fixture(scope="module")
def device_run(cache_dir):
    return train(config(cache_dir, trainer__max_steps=40, **DCN, **SCHEDULE, **ADAGRAD))


@pytest.mark.parametrize("placement", [
    dict(placement__kind="uvm"),
    dict(placement__kind="lookahead", placement__cache_rows=2500, placement__window=3),
    dict(placement__kind="cache", placement__cache_rows=2500, placement__policy="lfu"),
])
def test_dcn_with_schedule_is_exact_in_every_fp32_placement(cache_dir, device_run, placement):
    got = train(config(cache_dir, trainer__max_steps=40, **DCN, **SCHEDULE, **ADAGRAD, **placement))
    assert got.step_losses == device_run.step_losses
    for k, v in device_run.model.state_dict().items():
        assert torch.equal(got.model.state_dict()[k], v), k
    for name, t in device_run.embeddings.table_state().items():
        assert torch.equal(got.embeddings.table_state()[name]["weights"], t["weights"]), name


@pytest.mark.parametrize("precision, placement", [("int8", "device"), ("int4", "lookahead"), ("fp16", "uvm")])
def test_dcn_with_schedule_trains_in_low_precision(cache_dir, device_run, precision, placement):
    got = train(config(cache_dir, trainer__max_steps=40, **DCN, **SCHEDULE, **ADAGRAD, precision__kind=precision,
                       placement__kind=placement, placement__cache_rows=2500))
    assert len(got.step_losses) == 40
    # the same initial model, its tables quantized: nearly the same first loss
    assert got.step_losses[0] == pytest.approx(device_run.step_losses[0], abs=5e-3)
    mean = lambda losses: sum(losses[-20:]) / 20  # noqa: E731
    assert got.step_losses != device_run.step_losses
    assert mean(got.step_losses) == pytest.approx(mean(device_run.step_losses), abs=0.01)
    assert got.evals[-1]["auc"] > 0.55


def test_resume_mid_schedule_ends_where_an_uninterrupted_run_ends(cache_dir, device_run, tmp_path):
    common = dict(trainer__max_steps=40, **DCN, **SCHEDULE, **ADAGRAD)
    part = train(config(cache_dir, **{**common, "trainer__max_steps": 13}, placement__kind="lookahead",
                        placement__cache_rows=2500, trainer__checkpoint_dir=str(tmp_path / "ck")))
    assert part.step == 13
    resumed = train(config(cache_dir, **common, trainer__checkpoint_dir=str(tmp_path / "ck"), trainer__resume="true"))
    assert resumed.step_losses == device_run.step_losses[13:]
    for k, v in device_run.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k


def test_dcn_learns_the_synthetic_task(cache_dir):
    trainer = train(config(cache_dir, trainer__epochs=2, **DCN))
    assert trainer.evals[-2]["auc"] > 0.68


@pytest.mark.parametrize("overrides, message", [
    ({"optimizer.schedule": "cosine"}, "optimizer.schedule"),
    ({"optimizer.schedule": "warmup_poly", "optimizer.warmup_steps": 10, "optimizer.decay_start_step": 5},
     "optimizer.decay_start_step=5"),
    ({"model.init": "xavier"}, "model.init"),
    ({"optimizer.dense_kernel": "fast"}, "optimizer.dense_kernel"),
    ({"optimizer.dense_kernel": "fused"}, "optimizer.dense_kernel=fused is Adagrad's"),  # config()'s sgd
    ({"model.interaction": "dcn", "model.dcn_rank": 0}, "model.dcn_rank"),
])
def test_bad_model_and_schedule_settings_fail_at_start(cache_dir, overrides, message):
    from omegaconf.errors import ValidationError

    # A closed choice (an Enum of the schema) fails where it is set, naming the key; the rest when the Trainer starts.
    with pytest.raises((UserError, ValidationError), match=message):
        cfg = config(cache_dir)
        for k, v in overrides.items():
            OmegaConf.update(cfg, k, v)
        Trainer(cfg)


@pytest.mark.parametrize("name", ["dlrm_small", "dlrm_kaggle", "dlrm_v2", "dlrm_v2_small"])
def test_model_configs_validate(name):
    path = Path(__file__).resolve().parents[1] / "configs" / "model" / f"{name}.yaml"
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), {"model": OmegaConf.load(path)})
    from recsys_cli.config import validate

    validate(cfg)
    assert cfg.model.init == ("torch" if name.startswith("dlrm_v2") else "dlrm")
