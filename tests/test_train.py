"""The trainer end to end: runs, metrics files, checkpoints, resume, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

import recsys_cli.device as device_module
from recsys_cli import wait_policy
from recsys_cli.device import has_bf16_path
from recsys_cli.errors import UserError
from recsys_cli.train.metrics import roc_auc
from recsys_cli.train.trainer import Trainer
from devices import TEST_DEVICE, fresh_cuda_block
from train_config import assert_states_equal, config, state_of, train
from commands import RECSYS, train_in_process

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)

SMALL = ["dataset.synthetic.rows=20000", "dataset.synthetic.cardinality_scale=0.0005"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("recsys-cache")


def recsys(*args, cwd, env_extra=None, **kw):
    env = {**os.environ, "RECSYS_CACHE": str(cwd / "cache"), **(env_extra or {})}
    return subprocess.run([RECSYS, *args], cwd=cwd, env=env, capture_output=True, text=True, **kw)


def test_roc_auc_matches_pairwise_reference():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 20, (300,), generator=gen).float()  # many ties
    labels = (torch.rand(300, generator=gen) < 0.4).float()
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum()
    assert roc_auc(scores, labels) == pytest.approx((wins / (len(pos) * len(neg))).item(), abs=1e-12)
    assert roc_auc(labels, labels) == 1.0


def test_cli_train_writes_metrics_and_summary(tmp_path, monkeypatch):
    for key in wait_policy.USER_SETTINGS:  # tests/conftest.py sets the policy for the test processes
        monkeypatch.delenv(key, raising=False)
    result = recsys("train", *SMALL, "trainer.max_steps=60", "trainer.eval_every=30", "trainer.log_every=20",
                    "trainer.progress=false", "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "val AUC" in result.stdout and "samples/s" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "auc" in r]
    assert [r["step"] for r in steps] == [20, 40, 60]
    assert all(r["samples_per_second"] > 0 for r in steps)
    assert [(r["step"], r["split"]) for r in evals] == [(30, "val"), (60, "val"), (60, "test")]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["samples"] == 60 * 256
    assert set(summary["phase_seconds"]) >= {"data_wait", "embedding_forward", "mlp_forward", "backward",
                                             "sparse_update", "dense_update", "eval"}
    assert summary["embedding_bytes"]["device"] > 0
    assert summary["config"]["trainer"]["max_steps"] == 60
    assert (tmp_path / "run" / "checkpoints" / "latest.json").exists()
    # the entry point set the short spin count before torch loaded (no policy in its environment)
    assert summary["openmp_wait"] == "GOMP_SPINCOUNT=1000"


# Keys and values the config schema refuses: tests/test_bad_input.py (test_config_errors_exit_2_on_one_line).
@pytest.mark.parametrize(
    "override, message",
    [
        ("dataset=criteo_kaggle", "dataset.path"),
        ("dataset.path=/does/not/exist", "/does/not/exist"),
    ],
)
def test_bad_config_fails_at_start_naming_the_key(tmp_path, override, message, capsys, monkeypatch):
    result = train_in_process([*override.split(), "hydra.run.dir=run"], cwd=tmp_path, capsys=capsys,
                              monkeypatch=monkeypatch)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


def test_same_seed_same_results(cache_dir):
    a = train(config(cache_dir, trainer__max_steps=40))
    b = train(config(cache_dir, trainer__max_steps=40))
    assert a.step_losses == b.step_losses
    c = train(config(cache_dir, trainer__max_steps=40, trainer__seed=1))
    assert c.step_losses != a.step_losses


def test_learns_the_synthetic_task(cache_dir):
    trainer = train(config(cache_dir, trainer__epochs=2))
    assert trainer.evals[-2]["auc"] > 0.7  # val; the hidden model's own AUC is about 0.8


@pytest.mark.skipif(not has_bf16_path(torch.device("cpu")), reason="this CPU has no bf16 matrix path")
def test_bf16_dense_is_deterministic_and_resumes_exactly(cache_dir, tmp_path):
    """model.dense_precision=bf16 is not fp32's arithmetic, but it keeps the
    run-to-run and resume guarantees (README, Speed)."""
    steps = dict(trainer__max_steps=60, model__dense_precision="bf16", placement__kind="lookahead",
                 placement__cache_rows=3000)
    full = train(config(cache_dir, **steps))
    again = train(config(cache_dir, **steps))
    assert again.step_losses == full.step_losses
    assert_states_equal(state_of(again), state_of(full))
    fp32 = train(config(cache_dir, **{**steps, "model__dense_precision": "fp32"}))
    assert fp32.step_losses != full.step_losses  # the MLPs really ran in bf16
    part = train(config(cache_dir, **{**steps, "trainer__max_steps": 40}, trainer__checkpoint_dir=str(tmp_path / "ck")))
    resumed = train(config(cache_dir, **steps, trainer__checkpoint_dir=str(tmp_path / "ck"), trainer__resume="true"))
    assert part.step == 40 and resumed.step == 60
    assert resumed.step_losses == full.step_losses[40:]
    assert_states_equal(state_of(resumed), state_of(full))


def test_bf16_dense_is_refused_where_the_hardware_has_no_bf16_path(cache_dir, monkeypatch):
    monkeypatch.setattr(device_module, "has_bf16_path", lambda device: False)
    with pytest.raises(UserError, match=r"^model.dense_precision=bf16 but cpu here has no bf16 matrix path"):
        Trainer(config(cache_dir, model__dense_precision="bf16", trainer__device="cpu"))
    Trainer(config(cache_dir, trainer__device="cpu"))  # fp32 needs no bf16 path


@pytest.mark.parametrize("first, second", [("device", "device"), ("lookahead", "device"), ("device", "cache")])
def test_resume_ends_where_an_uninterrupted_run_ends(cache_dir, tmp_path, first, second):
    steps = dict(trainer__epochs=2, trainer__max_steps=200, optimizer__name="adagrad", optimizer__lr=0.05)
    place = lambda kind: dict(placement__kind=kind, placement__cache_rows=3000)  # noqa: E731
    full = train(config(cache_dir, **steps, **place("device")))
    # 125 steps per epoch: stop inside the second epoch, then resume elsewhere.
    part = train(config(cache_dir, **{**steps, "trainer__max_steps": 150}, **place(first),
                        trainer__checkpoint_dir=str(tmp_path / "ck")))
    assert part.step == 150
    resumed = train(config(cache_dir, **steps, **place(second), trainer__checkpoint_dir=str(tmp_path / "ck"),
                           trainer__resume="true"))
    assert resumed.step == 200
    assert resumed.step_losses == full.step_losses[150:]
    assert_states_equal(state_of(resumed), state_of(full))
    assert resumed.evals[-2] == full.evals[-2]


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    # keep_last=1 and keep_best: the run keeps one checkpoint and the best, and still resumes exactly;
    # 600 steps of 32 cross an epoch's end (the small data's train split) after the resume.
    args = [*SMALL, "trainer.max_steps=600", "trainer.epochs=3", "trainer.batch_size=32", "trainer.checkpoint_every=100",
            "trainer.progress=false", "+placement=lookahead", "placement.cache_ratio=0.5", "trainer.keep_last=1",
            "trainer.keep_best=true", "trainer.eval_every=200"]
    reference = recsys("train", *args, "hydra.run.dir=ref", cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr
    env = {**os.environ, "RECSYS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([RECSYS, "train", *args, "hydra.run.dir=killed"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = tmp_path / "killed" / "checkpoints" / "latest.json"
    deadline = time.time() + 600  # liveness only: the first checkpoint comes in seconds
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < 600, "the run finished before it could be killed"
    resumed = recsys("train", *args, "trainer.resume=true", "hydra.run.dir=resumed",
                     "trainer.checkpoint_dir=killed/checkpoints", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    ref = torch.load(tmp_path / "ref" / "checkpoints" / "step-00000600.pt", weights_only=False)
    end = torch.load(tmp_path / "killed" / "checkpoints" / "step-00000600.pt", weights_only=False)
    assert_states_equal(ref, end)
    ref_final = json.loads((tmp_path / "ref" / "summary.json").read_text())["final"]
    end_final = json.loads((tmp_path / "resumed" / "summary.json").read_text())["final"]
    assert ref_final == end_final
    kept = lambda run: sorted(p.name for p in (tmp_path / run / "checkpoints").glob("step-*.pt"))  # noqa: E731
    best = json.loads((tmp_path / "ref" / "checkpoints" / "best.json").read_text())
    assert kept("ref") == kept("killed") == sorted({"step-00000600.pt", best["file"]})
    assert json.loads((tmp_path / "killed" / "checkpoints" / "best.json").read_text()) == best
    assert_states_equal(torch.load(tmp_path / "ref" / "checkpoints" / best["file"], weights_only=False),
                        torch.load(tmp_path / "killed" / "checkpoints" / best["file"], weights_only=False))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(cache_dir, tmp_path):
    cfg = config(cache_dir, optimizer__lr=1e12, trainer__checkpoint_every=1, trainer__log_every=1,
                 trainer__max_steps=50, trainer__checkpoint_dir=str(tmp_path / "ck"))
    with pytest.raises(UserError, match=r"loss is nan at step \d+"):
        train(cfg)
    saved = torch.load(next((tmp_path / "ck").glob("step-*.pt")), weights_only=False)
    assert all(torch.isfinite(v).all() for v in saved["model"].values())


def test_manifest_features_must_match_the_model(cache_dir):
    with pytest.raises(UserError, match="expects sparse features"):
        Trainer(config(cache_dir, model__features=["C1", "C2"]))


def test_lookahead_reports_cache_and_window(cache_dir, tmp_path):
    trainer = Trainer(config(cache_dir, placement__kind="lookahead", placement__cache_ratio=0.3,
                             placement__window=4, trainer__max_steps=50), run_dir=tmp_path)
    summary = trainer.fit()
    cache = summary["cache"]
    assert cache["hits"] + cache["misses"] > 0 and 0 < cache["hit_rate"] < 1
    assert 1 <= cache["window_used_min"] <= cache["window_used_mean"] <= 4
    assert cache["bytes_to_device"] > 0 and summary["embedding_bytes"]["host"] > 0
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["cache"]["rows_loaded"] == cache["rows_loaded"]


@pytest.mark.parametrize("placement", ["device", "lookahead"])
def test_dedup_on_equals_off_on_session_data(cache_dir, placement):
    common = dict(dataset__name="synthetic_sessions", dataset__synthetic__sessions=True,
                  dataset__synthetic__multi_hot_features=2, dataset__synthetic__multi_hot_max_length=30,
                  dedup__keep_sessions=True, trainer__max_steps=30, placement__kind=placement,
                  placement__cache_ratio=0.5)
    off = train(config(cache_dir, **common, dedup__enabled=False))
    on = train(config(cache_dir, **common, dedup__enabled=True))
    torch.testing.assert_close(torch.tensor(on.step_losses), torch.tensor(off.step_losses), rtol=1e-6, atol=0)
    for name, tensors in off.embeddings.table_state().items():
        ref = tensors["weights"]
        torch.testing.assert_close(on.embeddings.table_state()[name]["weights"], ref, rtol=1e-6,
                                   atol=1e-6 * float(ref.abs().max()))
    dup_on, dup_off = on.duplication(), off.duplication()
    assert dup_on["duplicated_ids"] == pytest.approx(dup_off["duplicated_ids"])  # same batches
    assert dup_on["duplicated_ids"] > 0.5 and dup_on["lookups_saved_by_dedup"] > 0.3
    assert dup_off["lookups_saved_by_dedup"] == 0.0


def allocated_by_fake_cuda(runtime, build):
    """device.allocated_by as a CUDA run measures it: the allocator's blocks, one per device tensor."""
    embeddings = build()
    device = sum(fresh_cuda_block(n) for g in embeddings.groups for tier, _, n in g.memory() if tier == "device")
    return embeddings, {"device": device, "pinned_host": 0}


@pytest.mark.parametrize("budget", ["48KiB", "300KiB", "64MiB"])
def test_auto_placement_stays_within_the_budget(cache_dir, tmp_path, budget, monkeypatch):
    from recsys_cli.embeddings.placement_bytes import parse_bytes

    if TEST_DEVICE.type == "cpu":  # the trainer's budget check sees the CUDA allocator's rounding
        monkeypatch.setattr("recsys_cli.train.trainer.allocated_by", allocated_by_fake_cuda)
    trainer = Trainer(config(cache_dir, placement__kind="auto", placement__device_memory_budget=budget,
                             trainer__max_steps=30), run_dir=tmp_path)
    summary = trainer.fit()
    used, auto = summary["embedding_bytes"]["device"], summary["auto_placement"]
    assert used <= parse_bytes(budget) and used == auto["expected_bytes"]["device"]
    kinds = set(auto["placements"].values())
    assert kinds == {"device"} if budget == "64MiB" else "lookahead" in kinds
    assert summary["final"]["val"]["auc"] > 0.5
