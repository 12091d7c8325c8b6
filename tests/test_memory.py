"""RSS through a run (issue 18, goal 7): summary.json's memory trace."""

import json
import sys

import pytest

from recsys_cli.train.memory import RSSTrace, current_rss_bytes
from train_config import config

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS from /proc")


@linux
def test_current_rss_sees_an_allocation():
    before = current_rss_bytes()
    block = bytearray(64 << 20)  # touched: zero-filled
    block[::4096] = b"x" * len(block[::4096])
    assert current_rss_bytes() - before >= 48 << 20
    del block


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
    # ru_maxrss (the kernel's high-water mark) is updated lazily: the same order, not a bound
    assert memory["peak_rss_bytes"] > max(b for _, b in memory["rss_bytes"]) // 2
