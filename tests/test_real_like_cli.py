"""The real-data path from the command line, on a small Criteo-format TSV
(skewed hex values, empty fields, negatives): preprocess, train the default
lookahead config, export, score the raw rows (issue 28)."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
from pathlib import Path

import pytest
from commands import RECSYS, completed_in_process
from test_criteo_preprocess import write_raw


def real_like_rows(n: int, seed: int) -> list[list[str]]:
    """Criteo-like rows (40 strings): skewed hex values from pools of 3 to
    20,000 values, so that large tables hold more rows than 4 batches read."""
    rng = random.Random(seed)
    pools = [[f"{rng.getrandbits(32):08x}" for _ in range([3, 60, 2000, 20000][f % 4])] for f in range(26)]
    cum = [list(itertools.accumulate(1.0 / (i + 1) for i in range(len(p)))) for p in pools]
    rows = []
    for i in range(n):
        r = [str(int(rng.random() < 0.25)), *("" if rng.random() < 0.2 else str(rng.randint(-3, 5000)) for _ in range(13))]
        r += ["" if rng.random() < 0.1 else rng.choices(pools[f], cum_weights=cum[f])[0] for f in range(26)]
        rows.append(r)
    return rows


def recsys(*args, cwd):
    env = {**os.environ, "RECSYS_CACHE": str(cwd / "cache")}
    return subprocess.run([RECSYS, *args], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """4,000 raw rows preprocessed, trained with the default lookahead config."""
    tmp = tmp_path_factory.mktemp("real-like")
    rows = real_like_rows(4000, seed=3)
    write_raw(tmp / "train.txt", rows)
    pre = recsys("preprocess", "criteo", "input=train.txt", "output=data", "split=ratios", "ratios=[0.8,0.1,0.1]",
                 "progress=false", cwd=tmp)
    assert pre.returncode == 0, pre.stderr
    train = recsys("train", "dataset=criteo_kaggle", "dataset.path=data", "placement=lookahead",
                   "trainer.max_steps=6", "trainer.progress=false", "hydra.run.dir=run", cwd=tmp)
    return {"tmp": tmp, "rows": rows, "train": train}


def test_the_default_lookahead_cache_fits_a_small_real_dataset(run):
    """5 % of these tables is less than one batch needs: the cache is raised to
    what the window's batches can need, and the start-up line says so."""
    train = run["train"]
    assert train.returncode == 0, train.stdout + train.stderr
    manifest = json.loads((run["tmp"] / "data" / "manifest.json").read_text())
    rows = [f["vocab_size"] for f in manifest["sparse_features"]]
    expected = sum(min(n, 4 * 256) for n in rows)  # window 4 x batch 256 (the trainer.batch_size default), per table
    assert round(0.05 * sum(rows)) < 26 * 100 and expected < sum(rows)  # 5 %: less than a batch needs; not all
    line = next(ln for ln in train.stdout.splitlines() if ln.startswith("lookahead cache of"))
    assert f"{expected:,} slots" in line and "raised to what the 4 batches of the window can need" in line
    summary = json.loads((run["tmp"] / "run" / "summary.json").read_text())
    assert summary["cache"]["cache_slots"] == expected and summary["steps"] == 6


def test_the_export_scores_raw_rows_like_predict(run, one_compute_thread, capsys, monkeypatch):
    """`recsys export`'s artifact on raw TSV rows (load + one call) == `recsys
    predict` on the same rows, bit for bit (fp32, one batch of the same size).
    Both commands by main() in this process (commands.completed_in_process:
    what they write, not the process; the fixture's preprocess and train are
    real processes)."""
    import numpy as np
    import torch

    from recsys_cli.export import raw_inputs

    tmp, rows = run["tmp"], run["rows"][:700]
    rng = random.Random(9)  # and rows with values the vocabulary has never seen (id 0)
    rows += [r[:14] + [f"{rng.getrandbits(32):08X}" if v else "" for v in r[14:]] for r in rows[:50]]
    assert run["train"].returncode == 0, run["train"].stderr
    write_raw(tmp / "score.txt", [r[1:] for r in rows])  # unlabelled, like Criteo's test.txt
    monkeypatch.chdir(tmp)
    monkeypatch.setenv("RECSYS_CACHE", str(tmp / "cache"))
    export = completed_in_process(["export", "checkpoint=run", "output=model.pt2"], capsys)
    assert export.returncode == 0, export.stderr
    pred = completed_in_process(["predict", "checkpoint=run", "input=score.txt", "output=preds.csv",
                                 f"batch_size={len(rows)}", "device=cpu", "progress=false"], capsys)
    assert pred.returncode == 0, pred.stderr
    expected = np.array([np.float32(x) for x in (tmp / "preds.csv").read_text().splitlines()[1:]], dtype=np.float32)

    model = torch.export.load(str(tmp / "model.pt2")).module()
    dense, categorical = raw_inputs((tmp / "score.txt").read_text().splitlines())
    got = model(dense, categorical)
    assert len(expected) == len(rows) and torch.equal(got, torch.from_numpy(expected))
    # the rows exercise unseen values, missing values and negatives
    from data_tools.vocab import load_vocabulary

    vocab, new = load_vocabulary(tmp / "data"), categorical[-50:].numpy()
    assert sum((vocab.lookup(f, new[new[:, f] >= 0, f]) == 0).sum() for f in range(26)) > 1000
    assert (categorical == -1).any() and (dense < 0).any()
