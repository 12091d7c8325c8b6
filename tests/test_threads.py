"""The compute-thread policy (train/threads.py): a default that leaves a core
to each busy background thread, `trainer.threads` to override, applied while
fit() runs."""

from __future__ import annotations

import pytest
import torch

import recsys_cli.train.threads as threads
from recsys_cli.errors import UserError
from recsys_cli.train.threads import compute_threads, default_threads
from train_config import config


def test_default_rule():
    assert default_threads(cores=2, background=1) == 1  # this project's machine: the loader keeps a core
    assert default_threads(cores=16, background=1) == 15
    assert default_threads(cores=16, background=2) == 14  # loader and lookahead prefetcher
    assert default_threads(cores=16, background=2, local_processes=2) == 6  # two ranks share the cores
    assert default_threads(cores=1, background=2) == 1


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
