"""A low-precision run's evaluations score the model its checkpoint saves:
the cache's dirty rows rounded into the table's precision, as the checkpoint
rounds them. So `recsys evaluate` / `recsys predict` on a run's checkpoint
give the run's own figures, bit for bit."""

from __future__ import annotations

import pytest
import torch
from train_config import config

from recsys_cli.inference import load_model
from recsys_cli.predict import dataset_logits
from recsys_cli.train.trainer import Trainer

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)


@pytest.mark.parametrize("overrides", [
    {"precision__kind": "int4"},  # on-demand fp32 cache in front of int4 tables
    {"placement__kind": "lookahead", "placement__cache_ratio": 0.05, "precision__kind": "int8"},
], ids=["int4-cache", "int8-lookahead"])
def test_the_runs_evaluation_equals_its_checkpoints(tmp_path, overrides):
    cfg = config(tmp_path / "cache", trainer__max_steps=60, trainer__eval_batch_size=512, trainer__device="cpu",
                 trainer__checkpoint_dir=str(tmp_path / "run" / "checkpoints"), **overrides)
    (tmp_path / "run").mkdir()
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    trainer.fit()
    (group,) = [g for g in trainer.embeddings.groups if hasattr(g, "dirty")]
    assert bool(group.dirty.any()), "no dirty cached row: the test would not tell the two apart"
    logits, _ = trainer.predictions("val")
    loaded = load_model(tmp_path / "run", device="cpu")
    saved = torch.cat([lg for lg, _ in dataset_logits(loaded, trainer.data.directory, ["val"], 512)])
    assert torch.equal(logits, saved)
