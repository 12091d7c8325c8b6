"""The small TrainConfig the trainer tests build runs from."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from recsys_cli.config import TrainConfig
from recsys_cli.train.trainer import Trainer
from devices import TEST_DEVICE


def config(cache_dir, **overrides) -> TrainConfig:
    """Synthetic data of 20k rows in `cache_dir`, batch 128, no checkpoint during the run, no progress bar;
    overrides as keyword arguments with `__` for dots (trainer__max_steps=30)."""
    cfg = OmegaConf.structured(TrainConfig)
    cfg.dataset.cache_dir = str(cache_dir)
    cfg.dataset.synthetic.rows = 20000
    cfg.dataset.synthetic.cardinality_scale = 0.0005
    cfg.trainer.progress = False
    cfg.trainer.device = TEST_DEVICE.type  # cpu unless RECSYS_TEST_DEVICE says otherwise
    cfg.trainer.batch_size = 128
    cfg.trainer.log_every = 10
    cfg.trainer.checkpoint_every = None  # the schema's default before it became 1000 (issue 42 item 5)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, merge=True)
    return cfg


def train(cfg, run_dir=None) -> Trainer:
    """A Trainer for `cfg`, fitted, with every step's loss recorded."""
    trainer = Trainer(cfg, run_dir=run_dir)
    trainer.record_losses = True
    trainer.fit()
    return trainer


def state_of(trainer: Trainer) -> dict:
    """What a run learned: the dense model's state and every table's rows and optimizer state."""
    return {"model": trainer.model.state_dict(), "tables": trainer.embeddings.table_state()}


def assert_states_equal(a: dict, b: dict) -> None:
    """torch.equal on every tensor of two states (state_of, or a checkpoint's model and tables)."""
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for name, tensors in a["tables"].items():
        for k, v in tensors.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b["tables"][name][k]), (name, k)
