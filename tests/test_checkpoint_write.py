"""Checkpoints a user can switch off, and written without copying the tables."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("placement", [
    dict(placement__kind="lookahead", placement__cache_rows=3000, placement__window=4),
    dict(placement__kind="disk", placement__cache_rows=3000, placement__window=4, placement__host_cache_rows=64),
], ids=["lookahead", "disk"])
def test_a_cache_snapshot_hands_the_checkpoint_the_live_cache(tmp_path, placement):
    """cache_snapshot() gives the checkpoint the cache's own tensors, not
    clones: a save must not hold a second cache in host memory (issue 17's
    peak RSS). The save is synchronous, so the live tensors do not change
    while it writes them; exact resume is tested in test_resume_exact.py."""
    trainer = train(config(tmp_path / "data", trainer__max_steps=6, trainer__checkpoint_every=None,
                           trainer__final_checkpoint=False, **placement))
    snapshots = trainer.embeddings.cache_snapshot()
    cached = [(g, s) for g, s in zip(trainer.embeddings.groups, snapshots) if s is not None]
    assert cached
    for group, saved in cached:
        assert bool(group.dirty.any())  # there are dirty rows to patch, yet nothing is copied
        live = {"row_of_slot": group.row_of_slot, "dirty": group.dirty, "score": group.score,
                "free_slots": group.free_slots}
        if group.cache_rows.device.type == "cpu":  # from CUDA, .cpu() is the one copy there is
            live.update(cache_rows=group.cache_rows, cache_state=group.cache_state)
        for name, tensor in live.items():
            assert saved[name].data_ptr() == tensor.data_ptr(), name
