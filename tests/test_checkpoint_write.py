"""Checkpoints a user can switch off, and written without copying the tables."""

from __future__ import annotations

import torch
from train_config import config, train


def test_no_checkpoint_at_all_when_both_are_off(tmp_path):
    run_dir = tmp_path / "run"
    cfg = config(tmp_path / "data", trainer__max_steps=12, trainer__checkpoint_every=None,
                 trainer__final_checkpoint=False)
    trainer = train(cfg, run_dir)
    assert trainer.step == 12
    assert not (run_dir / "checkpoints").exists()


def test_the_final_checkpoint_is_still_written_by_default(tmp_path):
    run_dir = tmp_path / "run"
    train(config(tmp_path / "data", trainer__max_steps=12, trainer__checkpoint_every=None), run_dir)
    assert [p.name for p in (run_dir / "checkpoints").glob("step-*.pt")] == ["step-00000012.pt"]


def test_a_host_tables_snapshot_shares_the_live_storage(tmp_path):
    """table_state() of fp32 tables on the host gives views of the store, not
    copies: saving them costs no second copy of the tables in memory."""
    trainer = train(config(tmp_path / "data", trainer__max_steps=3, trainer__checkpoint_every=None,
                           trainer__final_checkpoint=False))
    tables = trainer.embeddings.table_state()
    host = [g for g in trainer.embeddings.groups if g.store.device.type == "cpu"]  # all of them on a CPU run
    for group in host:
        storage = group.store.rows.weights.untyped_storage().data_ptr()
        for t in group.tables:
            assert tables[t.name]["weights"].untyped_storage().data_ptr() == storage
            assert torch.equal(tables[t.name]["weights"], group.read(torch.arange(t.num_rows) + group.row_offset[t.name]))
