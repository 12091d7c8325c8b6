"""Steady-state throughput (train/throughput.py): samples/s after the warm-up,
with evaluations and checkpoints left out, beside the wall clock. Timed on a
fake clock that the test advances, so the figures are exact."""

from __future__ import annotations

import json

import pytest

import recsys_cli.train.throughput as throughput
from recsys_cli.train.throughput import ThroughputMeter, warmup_steps
from train_config import config


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_warmup_steps():
    assert [warmup_steps(n) for n in (1, 2, 19, 20, 99, 100, 10_000)] == [0, 1, 1, 2, 9, 10, 10]


def test_meter_leaves_out_the_warmup_evaluations_and_checkpoints():
    clock, synced = FakeClock(), []
    meter = ThroughputMeter(20, sync=lambda: synced.append(clock.now), clock=clock)
    assert meter.warmup == 2
    meter.start(samples=0)
    clock.advance(7.0)  # the wait for the first batch
    for step in range(1, 21):
        clock.advance(0.5)  # one step: 64 samples in 0.5 s
        meter.step(64 * step)
        if step == 10:
            with meter.paused("eval"):
                clock.advance(30.0)
        if step == 15:
            with meter.paused("checkpoint"):
                clock.advance(4.0)
    meter.end_training(64 * 20)
    with meter.paused("checkpoint"):  # the final checkpoint and evaluation: wall clock, not steady state
        clock.advance(2.0)
    with meter.paused("eval"):
        clock.advance(10.0)
    report = meter.report(samples=64 * 20)
    assert meter.samples_per_second == pytest.approx(128.0)  # 18 steps x 64 samples in 18 x 0.5 s
    assert report["steady_samples"] == 18 * 64 and report["steady_seconds"] == pytest.approx(9.0)
    assert report["eval_seconds"] == pytest.approx(40.0) and report["checkpoint_seconds"] == pytest.approx(6.0)
    assert report["wall_seconds"] == pytest.approx(7.0 + 10.0 + 40.0 + 6.0)
    assert report["wall_samples_per_second"] == pytest.approx(64 * 20 / 63.0)
    assert synced == [pytest.approx(108.0), pytest.approx(151.0)]  # the device is waited for at both edges


def test_meter_of_a_resumed_run_counts_its_own_samples_and_nested_pauses_once():
    clock = FakeClock()
    meter = ThroughputMeter(1, clock=clock)  # one step: no warm-up, the window is the whole loop
    meter.start(samples=1000)
    clock.advance(1.0)
    meter.step(1100)
    with meter.paused("eval"):
        clock.advance(1.0)
        with meter.paused("checkpoint"):
            clock.advance(1.0)
    meter.end_training(1100)
    report = meter.report(1100)
    assert meter.samples_per_second == pytest.approx(100.0)
    assert report["eval_seconds"] == pytest.approx(2.0) and report["wall_samples_per_second"] == pytest.approx(100 / 3)


def test_a_run_without_steps_after_the_warmup_has_no_steady_figure():
    meter = ThroughputMeter(5, clock=FakeClock())
    meter.start()
    meter.end_training(0)
    assert meter.samples_per_second is None and meter.report(0)["steady_samples"] == 0


def test_trainer_summary_excludes_periodic_evaluation_and_checkpoints(tmp_path, monkeypatch):
    """A real run with an evaluation every 10 steps and a checkpoint every 20,
    on a clock that moves only where the test says: 10 ms per training step,
    5 s per evaluation, 3 s per checkpoint."""
    from recsys_cli.train.trainer import Trainer

    clock = FakeClock()
    monkeypatch.setattr(throughput, "CLOCK", clock)
    real_step, real_eval, real_save = Trainer.train_step, Trainer.evaluate_and_log, Trainer.save

    def step(self, batch):
        clock.advance(0.01)
        return real_step(self, batch)

    def evaluate(self, split):
        clock.advance(5.0)
        return real_eval(self, split)

    def save(self):
        clock.advance(3.0)
        return real_save(self)

    monkeypatch.setattr(Trainer, "train_step", step)
    monkeypatch.setattr(Trainer, "evaluate_and_log", evaluate)
    monkeypatch.setattr(Trainer, "save", save)
    cfg = config(tmp_path / "cache", trainer__max_steps=40, trainer__eval_every=10, trainer__checkpoint_every=20,
                 trainer__batch_size=64)
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    summary = trainer.fit()
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    tp = on_disk["throughput"]
    # 4 warm-up steps, then 36 steps of 64 samples, 10 ms each.
    assert on_disk["samples_per_second"] == summary["samples_per_second"] == pytest.approx(6400.0)
    assert tp["warmup_steps"] == 4 and tp["steady_samples"] == 36 * 64
    # Evaluations at 10, 20, 30 and the final val and test; checkpoints at 20 and 40 (the last one is the final).
    assert tp["eval_seconds"] == pytest.approx(5 * 5.0) and tp["checkpoint_seconds"] == pytest.approx(2 * 3.0)
    assert tp["wall_seconds"] == pytest.approx(40 * 0.01 + 25.0 + 6.0)
    assert tp["wall_samples_per_second"] == pytest.approx(40 * 64 / tp["wall_seconds"])
