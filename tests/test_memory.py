"""RSS through a run (issue 18, goal 7): summary.json's memory trace."""

import json
import sys

import pytest

from recsys_cli.train.memory import RSSTrace, current_rss_bytes
from train_config import config

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS from /proc")


@linux
def test_current_rss_sees_an_allocation():
    import mmap

    # A fresh anonymous mapping: malloc could hand back freed heap pages that
    # are resident already (earlier tests leave some), and RSS would not move.
    block = mmap.mmap(-1, 64 << 20)
    before = current_rss_bytes()
    for offset in range(0, 64 << 20, 4096):  # touch every page
        block[offset] = 1
    assert current_rss_bytes() - before >= 48 << 20
    block.close()


@linux
def test_trace_stays_bounded_and_evenly_spread():
    trace = RSSTrace(limit=16)
    for step in range(1, 10_001):
        trace.sample(step)
    steps = [s for s, _ in trace.samples]
    assert 8 <= len(steps) <= 16
    assert steps[0] == 1 and all(b > a for a, b in zip(steps, steps[1:]))
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    assert len(gaps) == 1 and gaps.pop() >= 10_000 // 16  # one interval, doubled as needed
    assert all(rss > 0 for _, rss in trace.samples)


@linux
def test_summary_records_rss_at_log_steps(tmp_path):
    from recsys_cli.train.trainer import Trainer

    run = tmp_path / "run"
    trainer = Trainer(config(tmp_path, trainer__max_steps=30, trainer__log_every=10, trainer__checkpoint_every=None),
                      run_dir=run)
    trainer.eval_loaders = {}
    trainer.fit()
    memory = json.loads((run / "summary.json").read_text())["memory"]
    assert [s for s, _ in memory["rss_bytes"]] == [10, 20, 30]
    assert all(b > 0 for _, b in memory["rss_bytes"])
    # The peak is the run's high-water mark (VmHWM), so at least every sample; the
    # slack covers the kernel's per-CPU RSS counters, which each read sums a moment apart.
    assert memory["peak_rss_bytes"] >= max(b for _, b in memory["rss_bytes"]) - (4 << 20)


@linux
def test_a_child_reports_its_own_peak_not_its_parents():
    """summary.json's peak of a run started by a large process (a test
    session, a launcher that imported torch) is the run's own: a parent holding
    512 MiB starts a child, whose peak stays far below it. (getrusage's
    ru_maxrss, which Linux carries across fork and exec, reports the parent's.)"""
    import subprocess

    from recsys_cli.train.memory import peak_rss_bytes

    block = b"\x01" * (512 << 20)  # resident in this process
    assert peak_rss_bytes() > 512 << 20
    script = "from recsys_cli.train.memory import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    del block
    assert 0 < child < 128 << 20, f"the child reports a peak of {child / 2**20:.0f} MiB"


@pytest.mark.parametrize("placement,precision", [
    ("device", "fp32"), ("lookahead", "fp32"), ("lookahead", "int8"), ("cache", "fp32"), ("disk", "fp32"),
])
def test_a_finished_trainer_is_freed_without_the_cycle_collector(tmp_path, placement, precision):
    """Tensors' bytes never trigger Python's cycle collector, so a trainer in a
    reference cycle keeps its tables until some later collection: a process
    that trains one model after another (a sweep, a benchmark) ran out of
    memory at its tenth 2 GB model. The last reference gone, the trainer and
    every table tensor are freed at once."""
    import gc
    import weakref

    from recsys_cli.train.trainer import Trainer

    overrides = {"trainer__max_steps": 12, "trainer__checkpoint_every": None, "trainer__final_checkpoint": False,
                 "placement__kind": placement, "precision__kind": precision}
    if placement != "device":
        overrides.update(placement__cache_rows=2048)
    if placement == "disk":
        overrides.update(placement__disk_path=str(tmp_path / "disk"))
    trainer = Trainer(config(tmp_path, **overrides), run_dir=tmp_path / "run")
    trainer.fit()
    refs = [weakref.ref(trainer), weakref.ref(trainer.embeddings), *(weakref.ref(g) for g in trainer.embeddings.groups)]
    gc.collect()
    gc.disable()
    try:
        del trainer
        alive = [type(r()).__name__ for r in refs if r() is not None]
    finally:
        gc.enable()
    assert alive == []




def test_split_predictions_hold_every_batch_in_order(tmp_path):
    """Evaluation collects logits into tensors allocated once per split (not
    a list of per-batch tensors, which kept the heap from reusing the space
    around them: BENCHMARKS.md, "Evaluation memory by phase"). What it returns
    is exactly the batches' logits and labels in split order."""
    import torch

    from recsys_cli.train.metrics import SplitPredictions
    from recsys_cli.train.trainer import Trainer

    trainer = Trainer(config(tmp_path, trainer__eval_batch_size=128, trainer__checkpoint_every=None,
                             trainer__final_checkpoint=False))
    trainer.model.eval()
    with torch.no_grad():
        batches = [trainer.to_device(b) for b in trainer.eval_loaders["val"]]
        expected = torch.cat([trainer.model(b).cpu() for b in batches]), torch.cat([b.labels.cpu() for b in batches])
    assert len(batches) > 2 and batches[-1].size < 128  # a short last batch
    logits, labels = trainer.predictions("val")
    assert torch.equal(logits, expected[0]) and torch.equal(labels, expected[1])

    full = SplitPredictions(3)
    full.add(torch.ones(2), torch.ones(2))
    with pytest.raises(RuntimeError, match="4 predictions for a split of 3 rows"):
        full.add(torch.ones(2), torch.ones(2))
