"""Checkpoints a user can switch off, and written without copying the tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


CHECKPOINT_PEAK = """
import json, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import embedding_harness
embedding_harness.VOCAB = [400_000] * len(embedding_harness.FEATURES)
from embedding_harness import build, make_batches, train
from recsys_cli.checkpoints import save_checkpoint
from recsys_cli.train.memory import current_rss_bytes, peak_rss_bytes

model, opt = build({{"kind": "lookahead", "cache_rows": 4000, "window": 2}}, {{"kind": "int8"}}, optimizer="adagrad")
train(make_batches(20, batch_size=64), model, opt)  # the cache holds dirty rows: the snapshot has a patch
state = {{"step": 20, "model": model.state_dict(), "dense_optimizer": opt.state_dict(),
         "tables": model.embeddings.table_state(patch_beside=True), "caches": model.embeddings.cache_snapshot()}}
table_bytes = model.embeddings.memory()["table"]
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := the RSS now: the peak from here on is the checkpoint's
before = current_rss_bytes()
save_checkpoint(Path({ck!r}), 20, state)
print(json.dumps({{"growth": peak_rss_bytes() - before, "table_bytes": table_bytes}}))
"""


def test_a_checkpoint_of_low_precision_tables_does_not_copy_them(tmp_path):
    """int8 host tables behind a cache with dirty rows: the snapshot was a
    clone of every table (peak + 100 % of the tables, issue 27); the tables
    are now saved as views with the dirty rows beside them, so a
    checkpoint's peak grows by the patch, not the tables (the child's own
    VmHWM, reset before the save)."""
    script = CHECKPOINT_PEAK.format(tests=str(Path(__file__).parent), ck=str(tmp_path / "ck"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["table_bytes"] > 20 << 20
    assert got["growth"] < 0.2 * got["table_bytes"], got
