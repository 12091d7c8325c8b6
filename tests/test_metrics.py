"""Evaluation metrics against references computed another way."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from data_tools.metrics import roc_auc
from recsys_cli.train.metrics import binary_metrics, calibration, log_loss, normalized_entropy


def test_roc_auc_small_cases_and_inputs():
    assert roc_auc(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0, 0, 1, 1])) == 1.0
    assert roc_auc(np.array([0.5, 0.5, 0.5, 0.5]), np.array([0, 1, 0, 1])) == 0.5
    assert roc_auc(np.array([0.4, 0.3, 0.2, 0.1]), np.array([0, 0, 1, 1])) == 0.0
    assert roc_auc(torch.tensor([0.1, 0.9, 0.2]), torch.tensor([0.0, 1.0, 1.0])) == 1.0  # CPU tensors too
    assert math.isnan(roc_auc(np.array([0.1, 0.2]), np.array([1, 1])))


def test_roc_auc_equals_the_pairwise_count_with_ties():
    """AUC is the share of (positive, negative) pairs ranked right, ties half:
    counted pair by pair it is the same float the rank-sum formula gives."""
    gen = torch.Generator().manual_seed(3)
    scores = (torch.randn(600, generator=gen) * 3).round().numpy()  # many ties
    labels = (torch.rand(600, generator=gen) < 0.3).numpy()
    pos, neg = scores[labels], scores[~labels]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert roc_auc(scores, labels) == wins / (len(pos) * len(neg))


def _data(n=2000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, generator=gen, dtype=torch.float64) - 1
    labels = (torch.rand(n, generator=gen, dtype=torch.float64) < torch.sigmoid(logits)).double()
    return logits, labels


def test_log_loss_and_normalized_entropy_match_their_definitions():
    logits, labels = _data()
    probs = torch.sigmoid(logits)
    ref = sum(-math.log(p) if y else -math.log(1 - p) for p, y in zip(probs.tolist(), labels.tolist())) / len(probs)
    assert log_loss(labels, probs) == pytest.approx(ref, rel=1e-12)
    ctr = labels.mean().item()
    assert normalized_entropy(labels, probs) == pytest.approx(ref / -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr)),
                                                               rel=1e-12)
    # predicting the base rate everywhere has NE exactly 1; the true probabilities do better
    assert normalized_entropy(labels, torch.full_like(probs, ctr)) == pytest.approx(1.0, rel=1e-12)
    assert normalized_entropy(labels, probs) < 0.97
    assert math.isnan(normalized_entropy(torch.ones(5), torch.full((5,), 0.5)))
    # a certain mistake is finite
    assert math.isfinite(log_loss(torch.tensor([1.0]), torch.tensor([0.0])))


def test_calibration_is_mean_prediction_over_observed_rate():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert calibration(labels, torch.tensor([0.5, 0.5, 0.5, 0.5])) == pytest.approx(2.0)
    assert calibration(labels, torch.tensor([0.25, 0.25, 0.25, 0.25])) == pytest.approx(1.0)
    assert math.isnan(calibration(torch.zeros(3), torch.full((3,), 0.1)))


def test_binary_metrics_reports_calibration_beside_the_rest():
    logits, labels = _data()
    m = binary_metrics(logits.float(), labels.float())
    probs = torch.sigmoid(logits.float().double())
    assert m["samples"] == 2000
    assert m["observed_ctr"] == pytest.approx(labels.mean().item(), abs=1e-15)
    assert m["predicted_ctr"] == pytest.approx(probs.mean().item(), rel=1e-12)
    assert m["calibration"] == pytest.approx(m["predicted_ctr"] / m["observed_ctr"], rel=1e-12)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits.float().double(), labels).item()
    assert m["logloss"] == pytest.approx(bce, rel=1e-10)
    assert m["normalized_entropy"] == pytest.approx(normalized_entropy(labels, probs), rel=1e-12)
    assert m["auc"] == pytest.approx(roc_auc(logits.float().numpy(), labels.numpy()), abs=0)
    # shifted logits: same AUC, a visibly miscalibrated split
    shifted = binary_metrics(logits.float() + 1.5, labels.float())
    assert shifted["auc"] == pytest.approx(m["auc"], abs=1e-4)  # fp32 rounding may tie a close pair
    assert shifted["calibration"] > 1.5 and shifted["normalized_entropy"] > m["normalized_entropy"]


def test_roc_auc_in_many_passes_is_the_pairwise_count_of_float32_scores(monkeypatch):
    """A split's tie groups summed a few at a time (the memory bound of a
    split of millions of rows) give the pairwise count's float exactly, and
    float32 scores the same AUC as their float64 widening."""
    import data_tools.metrics as metrics

    gen = torch.Generator().manual_seed(5)
    scores = (torch.randn(700, generator=gen) * 4).round().float().numpy()  # ties across pass boundaries
    labels = (torch.rand(700, generator=gen) < 0.4).numpy()
    pos, neg = scores[labels], scores[~labels]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    monkeypatch.setattr(metrics, "_GROUPS_PER_PASS", 3)
    assert roc_auc(scores, labels) == wins / (len(pos) * len(neg))
    assert roc_auc(scores, labels) == roc_auc(scores.astype(np.float64), labels)
    distinct = torch.randn(700, generator=gen).numpy()
    monkeypatch.setattr(metrics, "_GROUPS_PER_PASS", 1 << 20)
    one_pass = roc_auc(distinct, labels)
    monkeypatch.setattr(metrics, "_GROUPS_PER_PASS", 64)
    assert roc_auc(distinct, labels) == one_pass


def test_binary_metrics_in_chunks_equals_its_definitions(monkeypatch):
    """Computed chunk by chunk, every metric equals the same figure computed
    over the whole split with the textbook expressions: exactly for counts
    (accuracy, observed rate), to rounding for the float64 sums."""
    import recsys_cli.train.metrics as metrics

    logits, labels = _data(n=1000, seed=4)
    logits, labels = logits.float(), labels.float()
    monkeypatch.setattr(metrics, "_CHUNK_ROWS", 96)  # 11 chunks, the last one short
    m = binary_metrics(logits, labels)
    z, y = logits.double(), labels.double()
    p = torch.sigmoid(z)
    assert m["accuracy"] == ((z > 0).double() == y).double().mean().item()
    assert m["observed_ctr"] == y.mean().item()
    assert m["predicted_ctr"] == pytest.approx(p.mean().item(), rel=1e-13)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(z, y).item()
    assert m["logloss"] == pytest.approx(bce, rel=1e-10)
    assert m["auc"] == roc_auc(z.numpy(), y.numpy())
    # The same sums as the metrics' own functions of the probabilities, chunked alike.
    assert m["logloss"] == log_loss(labels, p)
    assert m["normalized_entropy"] == normalized_entropy(labels, p)
    assert m["calibration"] == calibration(labels, p)


def test_binary_metrics_memory_is_a_few_chunks_not_copies_of_the_split():
    """A Kaggle-sized split (3.27M rows): the metrics raise the process's peak
    RSS by what the AUC's sort needs (its int64 order and the sorted scores,
    about 40 MB), not by float64 copies of the split (26 MB each; the code
    before this bound raised it by 208 MiB)."""
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import torch\n"
        "from recsys_cli.train.memory import current_rss_bytes, peak_rss_bytes\n"
        "from recsys_cli.train.metrics import binary_metrics\n"
        "n = 3_274_329\n"
        "g = torch.Generator().manual_seed(0)\n"
        "logits = torch.randn(n, generator=g)\n"
        "labels = (torch.rand(n, generator=g) < torch.sigmoid(logits)).float()\n"
        "binary_metrics(logits[:1000], labels[:1000])\n"
        "before = current_rss_bytes()\n"
        "binary_metrics(logits, labels)\n"
        "print(peak_rss_bytes() - before)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])  # a fresh process: its peak is the metrics' own
    growth = int(out.stdout.split()[-1])
    assert growth < 100 * 2**20, f"binary_metrics raised peak RSS by {growth / 2**20:.0f} MiB"


def test_roc_curve_is_the_rates_at_every_distinct_threshold(monkeypatch):
    """Each point is (FPR, TPR) of predicting positive at or above one of the
    distinct scores, from the highest down, counted threshold by threshold;
    float32 scores give the float64 widening's curve, and calibration bins
    counted in chunks are the bins counted row by row."""
    import recsys_cli.train.metrics as metrics
    from recsys_cli.train.metrics import calibration_bins, roc_curve

    gen = torch.Generator().manual_seed(8)
    scores = (torch.randn(500, generator=gen) * 3).round().float()  # ties
    labels = (torch.rand(500, generator=gen) < 0.35).float()
    curve = roc_curve(scores, labels, points=10_000)
    pos, neg = labels > 0.5, labels < 0.5
    fpr, tpr = [0.0], [0.0]
    for t in torch.unique(scores).flip(0):
        fpr.append(((scores >= t) & neg).sum().item() / neg.sum().item())
        tpr.append(((scores >= t) & pos).sum().item() / pos.sum().item())
    assert curve == {"fpr": fpr, "tpr": tpr}
    assert roc_curve(scores.double(), labels, points=10_000) == curve
    thinned = roc_curve(scores, labels, points=5)
    assert len(thinned["fpr"]) == 5 and thinned["fpr"][0] == 0.0 and thinned["tpr"][-1] == 1.0

    probs = torch.sigmoid(torch.randn(1000, generator=gen, dtype=torch.float64))
    clicks = (torch.rand(1000, generator=gen, dtype=torch.float64) < probs).double()
    chunked = calibration_bins(clicks, probs, bins=7)
    for b in chunked:
        inside = (probs >= b["lo"]) & ((probs < b["hi"]) | (b["hi"] == 1.0))
        assert b["rows"] == inside.sum().item()
        if b["rows"]:
            assert b["predicted"] == pytest.approx(probs[inside].mean().item(), rel=1e-12)
            assert b["observed"] == pytest.approx(clicks[inside].mean().item(), rel=1e-12)
    monkeypatch.setattr(metrics, "_CHUNK_ROWS", 64)
    assert [b["rows"] for b in calibration_bins(clicks, probs, bins=7)] == [b["rows"] for b in chunked]
