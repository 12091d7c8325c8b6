"""The compute-thread policy (train/threads.py): a default that leaves a core
to each busy background thread, `trainer.threads` to override, applied while
fit() runs."""

from __future__ import annotations

import pytest
import torch

import recsys_cli.train.threads as threads
from recsys_cli.errors import UserError
from recsys_cli import wait_policy
from recsys_cli.train.threads import WIDE_STEP_MACS, compute_threads, default_threads, matmul_macs_per_sample
from train_config import config


def test_default_rule():
    assert default_threads(cores=2, background=1) == 1  # this project's machine: the loader keeps a core
    assert default_threads(cores=16, background=1) == 15
    assert default_threads(cores=16, background=2) == 14  # loader and lookahead prefetcher
    assert default_threads(cores=16, background=2, local_processes=2) == 6  # two ranks share the cores
    assert default_threads(cores=1, background=2) == 1


def test_wide_steps_take_every_core():
    assert default_threads(cores=2, background=1, step_macs=WIDE_STEP_MACS) == 2
    assert default_threads(cores=2, background=1, step_macs=WIDE_STEP_MACS - 1) == 1
    assert default_threads(cores=16, background=2, step_macs=WIDE_STEP_MACS) == 16
    assert default_threads(cores=2, background=1, local_processes=2, step_macs=WIDE_STEP_MACS) == 1


def _kaggle_macs() -> int:
    """dlrm_kaggle's linear layers by hand: bottom 13-512-256-64-16, top (367 = 16 + 27*26/2)-512-256-1."""
    widths = [(13, 512), (512, 256), (256, 64), (64, 16), (16 + 27 * 26 // 2, 512), (512, 256), (256, 1)]
    return sum(a * b for a, b in widths)


@pytest.mark.parametrize("batch, expected", [(512, 1), (1024, 2)])
def test_dlrm_kaggle_takes_both_cores_from_batch_1024(tmp_path, monkeypatch, batch, expected):
    """The measured points (BENCHMARKS.md): on 2 cores beside the loader, one thread at batch
    512, both from 1024, counted from the model's own layers."""
    from recsys_cli.train.trainer import Trainer

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    trainer = Trainer(config(tmp_path / "cache", trainer__max_steps=2, trainer__batch_size=batch,
                             model__bottom_mlp=[512, 256, 64, 16], model__top_mlp=[512, 256, 1]))
    assert matmul_macs_per_sample(trainer.model) == _kaggle_macs() == 474_368
    assert trainer.fit()["compute_threads"] == expected


def test_wait_policy_is_set_before_torch_unless_the_user_chose():
    env: dict[str, str] = {}
    assert wait_policy.set_default(env, modules={}) and env == {"GOMP_SPINCOUNT": "1000"}
    assert wait_policy.in_force(env) == "GOMP_SPINCOUNT=1000"
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        assert not wait_policy.set_default(env, modules={}) and env == chosen
    env = {}
    assert not wait_policy.set_default(env, modules={"torch": torch}) and env == {}  # too late to take effect
    assert wait_policy.in_force({}) == "runtime default"


def test_compute_threads_sets_and_restores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 9)
    before = torch.get_num_threads()
    with compute_threads(None, background=2) as n:
        assert n == 7 == torch.get_num_threads()
    with compute_threads(3, background=2) as n:
        assert n == 3 == torch.get_num_threads()
    assert torch.get_num_threads() == before
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's choice is kept unless trainer.threads says otherwise
    with compute_threads(None, background=2) as n:
        assert n == before


def test_available_cores_is_positive_and_within_the_machine():
    import os

    assert 1 <= threads.available_cores() <= (os.cpu_count() or 1)


@pytest.mark.parametrize("placement, requested, expected", [
    ("device", None, 5),  # 6 cores, the loader: 5
    ("lookahead", None, 4),  # ... and the prefetcher: 4
    ("device", 2, 2),
])
def test_trainer_trains_with_the_policy_and_reports_it(tmp_path, monkeypatch, placement, requested, expected):
    from recsys_cli.train.trainer import Trainer

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 6)
    seen = []
    real_step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self, batch: seen.append(torch.get_num_threads())
                        or real_step(self, batch))
    before = torch.get_num_threads()
    cfg = config(tmp_path / "cache", trainer__max_steps=3, trainer__threads=requested, placement__kind=placement,
                 placement__cache_ratio=0.5)
    summary = Trainer(cfg).fit()
    assert seen == [expected] * 3 and summary["compute_threads"] == expected
    assert torch.get_num_threads() == before


def test_trainer_threads_must_be_positive(tmp_path):
    from recsys_cli.train.trainer import Trainer

    with pytest.raises(UserError, match="trainer.threads must be >= 1"):
        Trainer(config(tmp_path / "cache", trainer__threads=0))
