"""`recsys predict`: raw TSV == the preprocessed dataset == the trainer's own
evaluation, bit for bit in fp32; unlabelled input; atomic output; bad input."""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from commands import RECSYS, in_process
from test_criteo_preprocess import make_rows, write_raw
from train_config import config

from data_tools.criteo import CriteoConfig, preprocess
from data_tools.manifest import load_manifest
from recsys_cli.errors import UserError
from recsys_cli.inference import load_model
from recsys_cli.predict import PredictConfig, dataset_logits, predict, raw_logits, training_vocabulary
from recsys_cli.train.trainer import Trainer

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Criteo-format dataset (vocabulary mode, ratios split), a short run on
    it, the run's own val logits, and the raw lines of the val split."""
    tmp = tmp_path_factory.mktemp("predict")
    rows = make_rows(3000, seed=5)
    raw = write_raw(tmp / "train.txt", rows)
    m = preprocess(CriteoConfig(input=str(raw), output=str(tmp / "data"), split_by="ratios", split_ratios=[0.8, 0.1, 0.1],
                                progress=False))
    cfg = config(tmp / "cache", dataset__path=str(tmp / "data"), trainer__max_steps=40, trainer__batch_size=64,
                 trainer__eval_batch_size=128, trainer__checkpoint_dir=str(tmp / "run" / "checkpoints"),
                 trainer__device="cpu")
    (tmp / "run").mkdir()
    trainer = Trainer(cfg, run_dir=tmp / "run")
    trainer.fit()
    logits, labels = trainer.predictions("val")
    n_train = m.splits["train"].rows
    val_rows = rows[n_train:n_train + m.splits["val"].rows]
    return {"tmp": tmp, "rows": rows, "val_rows": val_rows, "logits": logits, "labels": labels,
            "run": tmp / "run", "data": tmp / "data", "trainer": trainer}


def test_raw_equals_dataset_equals_trainer(trained, tmp_path):
    loaded = load_model(trained["run"], device="cpu")
    ref = trained["logits"]
    from_dataset = torch.cat([lg for lg, _ in dataset_logits(loaded, trained["data"], ["val"], 128)])
    assert torch.equal(from_dataset, ref)
    raw = write_raw(tmp_path / "val.txt", trained["val_rows"])
    vocab = training_vocabulary(loaded, None)
    out = list(raw_logits(loaded, [raw], vocab, True, 128, block_size=4096))  # many small blocks, re-batched
    assert [len(lg) for lg, _ in out[:-1]] == [128] * (len(out) - 1)
    assert torch.equal(torch.cat([lg for lg, _ in out]), ref)
    assert torch.equal(torch.cat([lb for _, lb in out]), trained["labels"])
    # unlabelled (39 fields, gzip'd): the same logits
    raw39 = write_raw(tmp_path / "test.txt.gz", [r[1:] for r in trained["val_rows"]], gz=True)
    out39 = torch.cat([lg for lg, _ in raw_logits(loaded, [raw39], vocab, False, 128, block_size=4096)])
    assert torch.equal(out39, ref)


def read_csv(path: Path):
    lines = path.read_text().splitlines()
    return lines[0], [line.split(",") for line in lines[1:]]


def test_predict_command_writes_input_order_csv(trained, tmp_path):
    raw39 = write_raw(tmp_path / "test.txt", [r[1:] for r in trained["val_rows"]])
    out = tmp_path / "sub" / "preds.csv"
    predict(PredictConfig(checkpoint=str(trained["run"]), input=str(raw39), output=str(out), id_start=60000000,
                          progress=False, device="cpu"))
    header, rows = read_csv(out)
    assert header == "Id,Predicted"
    assert [int(r[0]) for r in rows] == list(range(60000000, 60000000 + len(trained["val_rows"])))
    probs = np.array([np.float32(r[1]) for r in rows], dtype=np.float32)
    np.testing.assert_array_equal(probs, torch.sigmoid(trained["logits"]).numpy())
    assert not list(out.parent.glob(".*tmp*"))
    # the preprocessed dataset as input, every split in input order
    out2 = tmp_path / "all.csv"
    predict(PredictConfig(checkpoint=str(trained["run"] / "checkpoints"), input=str(trained["data"]),
                          output=str(out2), progress=False, device="cpu"))
    header, rows2 = read_csv(out2)
    assert header == "Predicted" and len(rows2) == len(trained["rows"])
    m = load_manifest(trained["data"])
    lo = m.splits["train"].rows
    np.testing.assert_array_equal(np.array([np.float32(r[0]) for r in rows2[lo:lo + len(rows)]]), probs)


def test_unlabelled_dataset_with_vocab(trained, tmp_path):
    """preprocess labels=false vocab=TRAINED, then predict on that dataset."""
    raw39 = write_raw(tmp_path / "test.txt", [r[1:] for r in trained["val_rows"]])
    preprocess(CriteoConfig(input=str(raw39), output=str(tmp_path / "unl"), vocab=str(trained["data"]),
                            labels=False, split_by="none", progress=False))
    loaded = load_model(trained["run"], device="cpu")
    got = [(lg, lb) for lg, lb in dataset_logits(loaded, tmp_path / "unl", ["all"], 128)]
    assert torch.equal(torch.cat([lg for lg, _ in got]), trained["logits"])
    assert torch.isnan(torch.cat([lb for _, lb in got])).all()


def test_predict_bad_input(trained, tmp_path):
    good = write_raw(tmp_path / "ok.txt", trained["val_rows"][:10])
    base = dict(checkpoint=str(trained["run"]), input=str(good), output=str(tmp_path / "p.csv"), progress=False,
                device="cpu")
    with pytest.raises(UserError, match="checkpoint .*missing.* does not exist"):
        predict(PredictConfig(**{**base, "checkpoint": str(tmp_path / "missing")}))
    bad = tmp_path / "bad.txt"
    bad.write_text("\t".join(trained["val_rows"][0][:30]) + "\n")
    with pytest.raises(UserError, match=r"bad.txt line 1: expected 40 tab-separated fields .* found 30"):
        predict(PredictConfig(**{**base, "input": str(bad)}))
    # a row with a wrong field count after good ones: named by line, and no output left behind
    lines = ["\t".join(r) for r in trained["val_rows"][:5]] + ["\t".join(trained["val_rows"][5][1:])]
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"bad.txt line 6: expected 40 tab-separated fields, found 39: the line looks unlabelled .*labels=false for unlabelled ones"):
        predict(PredictConfig(**{**base, "input": str(bad), "labels": True}))
    assert not (tmp_path / "p.csv").exists() and not list(tmp_path.glob(".p.csv.tmp*"))
    # another vocabulary: a dataset built from other rows
    other = write_raw(tmp_path / "other.txt", make_rows(500, seed=9))
    preprocess(CriteoConfig(input=str(other), output=str(tmp_path / "other"), progress=False))
    with pytest.raises(UserError, match="vocabulary mismatch"):
        predict(PredictConfig(**{**base, "input": str(tmp_path / "other")}))
    with pytest.raises(UserError, match="vocabulary mismatch"):
        predict(PredictConfig(**{**base, "vocab": str(tmp_path / "other")}))
    # an option of the other kind of input is refused, not ignored (split=nosuch scored every raw line)
    with pytest.raises(UserError, match="is raw TSV, scored line by line: split= picks a split of a dataset"):
        predict(PredictConfig(**{**base, "split": "nosuch"}))
    with pytest.raises(UserError, match="is a dataset directory: vocab= and labels= are for raw TSV input"):
        predict(PredictConfig(**{**base, "input": str(trained["data"]), "labels": True}))
    assert not (tmp_path / "p.csv").exists()


def test_an_empty_line_is_an_error_naming_it_and_writes_nothing(trained, tmp_path, capsys, monkeypatch):
    """An empty line of raw input was dropped silently: 200 lines with one
    empty gave 199 predictions, and with id_start= every id after it was off
    by one from its input line. predict scores every row (it has no on_error):
    an error naming the file and line, exit 2, no output."""
    lines = ["\t".join(r) for r in trained["val_rows"][:20]]
    raw = tmp_path / "in.txt"
    raw.write_text("\n".join(lines[:7] + [""] + lines[7:]) + "\n")
    out = tmp_path / "p.csv"
    monkeypatch.setenv("COLUMNS", "400")
    code, stderr = in_process(["predict", f"checkpoint={trained['run']}", f"input={raw}", f"output={out}",
                               "id_start=100", "progress=false", "device=cpu"], capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith(f"error: {raw} line 8: an empty line (expected 40 tab-separated fields)"), stderr
    assert not out.exists() and not list(tmp_path.glob(".p.csv.tmp*"))
    raw.write_text("\r\n".join(lines) + "\r\n")  # a final line end (CRLF too) is no empty line
    code, stderr = in_process(["predict", f"checkpoint={trained['run']}", f"input={raw}", f"output={out}",
                               "id_start=100", "progress=false", "device=cpu"], capsys)
    assert code == 0, stderr
    assert len(out.read_text().splitlines()) == 1 + 20


def test_the_serving_parser_gives_one_row_an_item_or_names_the_empty_one(trained):
    """export.raw_inputs skipped empty items: a caller matching its scores to
    its requests by position was off by one after the first."""
    from recsys_cli.export import raw_inputs

    lines = ["\t".join(r) for r in trained["val_rows"][:5]]
    dense, _ = raw_inputs(lines)
    assert dense.shape[0] == 5
    for empty in ("", "\n", "\r\n"):
        with pytest.raises(ValueError, match=r"^line 3: an empty line \(expected 40 tab-separated fields\)"):
            raw_inputs(lines[:2] + [empty] + lines[2:])
    with pytest.raises(ValueError, match=r"^line 1: an empty line"):
        raw_inputs([""] + lines)


def test_truncated_checkpoint_and_missing_shard(trained, tmp_path):
    import shutil

    bad = tmp_path / "step-00000001.pt"
    bad.write_bytes((trained["run"] / "checkpoints" / sorted(
        p.name for p in (trained["run"] / "checkpoints").glob("step-*.pt"))[-1]).read_bytes()[:1000])
    with pytest.raises(UserError, match="cannot read checkpoint"):
        load_model(bad)
    data = tmp_path / "data"
    shutil.copytree(trained["data"], data)
    m = load_manifest(data)
    (data / m.splits["val"].shards[0].file).unlink()
    with pytest.raises(UserError, match="shard listed in the manifest is missing"):
        predict(PredictConfig(checkpoint=str(trained["run"]), input=str(data), split="val",
                              output=str(tmp_path / "p.csv"), progress=False, device="cpu"))
    assert not (tmp_path / "p.csv").exists()


def test_cli_errors_are_one_line_exit_2(trained, tmp_path, capsys, monkeypatch):
    cases = [
        ["predict", f"checkpoint={tmp_path / 'nope'}", f"input={tmp_path}", f"output={tmp_path / 'p.csv'}"],
        ["predict", f"checkpoint={trained['run']}", f"input={tmp_path / 'none.txt'}", f"output={tmp_path / 'p.csv'}"],
        ["predict", "checkpoint=x", "bogus=1"],
        ["predict", f"checkpoint={trained['run']}", f"input={trained['tmp'] / 'train.txt'}",
         f"output={tmp_path / 'p.csv'}", f"vocab={tmp_path}"],
        ["evaluate", f"checkpoint={tmp_path / 'nope'}"],
        ["evaluate", f"checkpoint={trained['run']}", "split=nosuch", f"output={tmp_path / 'e'}"],
        ["export", f"checkpoint={trained['run']}", "convert=int3"],
        ["export", f"checkpoint={tmp_path / 'nope'}"],
    ]
    monkeypatch.setenv("COLUMNS", "400")
    for argv in cases:  # main() here: the process start-up is the same for every case
        code, stderr = in_process(argv, capsys)
        assert code == 2, stderr
        assert stderr.startswith("error:") and len(stderr.strip().splitlines()) == 1, stderr
    # and one through the installed entry point, as a user runs it
    r = subprocess.run([RECSYS, *cases[0]], capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"})
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("error:"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_device_error_names_the_commands_own_option(trained, tmp_path, capsys, monkeypatch):
    """predict and evaluate take device=, not trainer.device=: the error says what to change."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["predict", f"checkpoint={trained['run']}", f"input={trained['tmp'] / 'train.txt'}",
                  f"output={tmp_path / 'p.csv'}", "device=cuda"],
                 ["evaluate", f"checkpoint={trained['run']}", f"output={tmp_path / 'e'}", "device=gpu"]):
        code, stderr = in_process(argv, capsys)
        assert code == 2 and stderr.startswith("error: device=") and "trainer.device" not in stderr, stderr
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "e").exists()


@pytest.mark.parametrize("command, option, message", [
    ("predict", "batch_size=0", "batch_size must be >= 1 (or unset), got 0"),  # was the run's default, silently
    ("predict", "batch_size=-3", "batch_size must be >= 1 (or unset), got -3"),
    ("predict", "threads=0", "threads must be >= 1 (or unset), got 0"),  # was the default
    ("predict", "threads=-1", "threads must be >= 1 (or unset), got -1"),  # was torch's RuntimeError
    ("predict", "block_size=0", "block_size must be >= 1, got 0"),  # read nothing: a CSV of no predictions
    ("evaluate", "batch_size=0", "batch_size must be >= 1 (or unset), got 0"),  # was the run's default
    ("evaluate", "batch_size=-3", "batch_size must be >= 1 (or unset), got -3"),  # was the loader's ValueError
    ("evaluate", "bins=0", "bins must be >= 1, got 0"),
])
def test_a_count_of_zero_is_refused_not_read_as_the_default(trained, tmp_path, capsys, monkeypatch, command, option,
                                                            message):
    """An unset option means the default; 0 is a value, and a count of 0 (or
    less) is refused as one line, exit 2, before any output is written."""
    out = tmp_path / "out"
    argv = [command, f"checkpoint={trained['run']}", option, f"output={out}", "progress=false", "device=cpu"]
    if command == "predict":
        argv.append(f"input={write_raw(tmp_path / 'in.txt', trained['val_rows'][:10])}")
    monkeypatch.setenv("COLUMNS", "400")
    code, stderr = in_process(argv, capsys)
    assert (code, stderr) == (2, f"error: {message}\n")
    assert not out.exists()


# --------------------------------------------------------------------------- recsys evaluate


def test_evaluate_matches_the_trainers_metrics(trained, tmp_path):
    import json

    from recsys_cli.evaluate import EvaluateConfig, evaluate
    from recsys_cli.train.metrics import binary_metrics, calibration, normalized_entropy

    out = tmp_path / "eval"
    result = evaluate(EvaluateConfig(checkpoint=str(trained["run"]), split="val", output=str(out), progress=False,
                                     device="cpu"))
    ref = binary_metrics(trained["logits"], trained["labels"])
    for k in ("auc", "logloss", "accuracy", "samples"):
        assert result[k] == ref[k]
    probs = torch.sigmoid(trained["logits"].double())
    assert result["normalized_entropy"] == normalized_entropy(trained["labels"], probs)
    assert result["calibration"] == calibration(trained["labels"], probs)
    bins = result["calibration_bins"]
    assert sum(b["rows"] for b in bins) == len(trained["labels"])
    p, y = probs.numpy(), trained["labels"].numpy()
    for b in bins:
        inside = (p >= b["lo"]) & ((p < b["hi"]) | (b["hi"] == 1.0))
        assert b["rows"] == inside.sum()
        if b["rows"]:
            assert b["observed"] == pytest.approx(y[inside].mean()) and b["predicted"] == pytest.approx(p[inside].mean())
    # the ROC curve's area is the AUC
    fpr, tpr = np.array(result["roc"]["fpr"]), np.array(result["roc"]["tpr"])
    assert np.trapezoid(tpr, fpr) == pytest.approx(ref["auc"], abs=1e-9)
    assert json.loads((out / "evaluation.json").read_text())["auc"] == ref["auc"]
    for png in ("roc.png", "calibration.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the calibration plot says how many rows each point stands for (issue 28)
    from recsys_cli.evaluate import calibration_figure

    ax = calibration_figure(result).axes[0]
    assert [t.get_text() for t in ax.texts] == [f"{b['rows']:,}" for b in bins if b["rows"]]
    assert "rows in its bin" in ax.get_legend().get_texts()[0].get_text()
    # rerun replaces its own output; a foreign directory is refused
    evaluate(EvaluateConfig(checkpoint=str(trained["run"]), split="val", output=str(out), progress=False,
                            device="cpu", plots=False))
    assert not (out / "roc.png").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="was not written by `recsys evaluate`"):
        evaluate(EvaluateConfig(checkpoint=str(trained["run"]), output=str(tmp_path / "mine"), progress=False))
    assert (tmp_path / "mine" / "keep.txt").exists()


def test_evaluate_and_train_refuse_unlabelled(trained, tmp_path):
    from recsys_cli.evaluate import EvaluateConfig, evaluate

    raw39 = write_raw(tmp_path / "test.txt", [r[1:] for r in trained["val_rows"]])
    preprocess(CriteoConfig(input=str(raw39), output=str(tmp_path / "unl"), vocab=str(trained["data"]),
                            labels=False, split_by="none", progress=False))
    with pytest.raises(UserError, match="has no labels"):
        evaluate(EvaluateConfig(checkpoint=str(trained["run"]), input=str(tmp_path / "unl"), progress=False))
    with pytest.raises(UserError, match="has no labels"):
        Trainer(config(tmp_path / "cache", dataset__path=str(tmp_path / "unl")))


# --------------------------------------------------------------------------- recsys export

# Stated tolerance of the quantized exports against the fp32 checkpoint: the
# largest change of a click probability on the test's val rows (README).
# What moves the probabilities is the precision's rounding of the rows (a
# step of 2^-11, 1/255 and 1/15 of a row's range): deterministic rounding of
# the same checkpoint, the same on every CPU; the machine's kernels add only
# fp32's last bits. Measured 1.2e-5, 1.6e-4, 3.3e-3: each bound is 6-12x that.
EXPORT_TOLERANCE = {"fp16": 1e-4, "int8": 2e-3, "int4": 2e-2}


def val_inputs(trained):
    """The artifact's raw inputs for the val rows, from their TSV lines."""
    from recsys_cli.export import raw_inputs

    return raw_inputs("\t".join(r) + "\n" for r in trained["val_rows"])


def test_raw_inputs_parse_like_preprocess(trained):
    dense, categorical = val_inputs(trained)
    rows = trained["val_rows"]
    assert dense.dtype == categorical.dtype == torch.int64
    assert torch.equal(dense, torch.tensor([[int(x) if x else 0 for x in r[1:14]] for r in rows]))
    assert torch.equal(categorical, torch.tensor([[int(v, 16) if v else -1 for v in r[14:]] for r in rows]))
    from recsys_cli.export import raw_inputs

    d39, c39 = raw_inputs(["\t".join(r[1:]) for r in rows[:5]])  # unlabelled, no line ends
    assert torch.equal(d39, dense[:5]) and torch.equal(c39, categorical[:5])
    bad = ["\t".join(r) for r in rows[:3]] + ["\t".join(rows[3][:20] + ["xyz"] + rows[3][21:])]
    with pytest.raises(ValueError, match=r"line 4: column C7: 'xyz' is not 8 hex digits"):
        raw_inputs(bad)


def test_dense_transform_numpy_equals_torch():
    """The artifact's dense transform (torch) gives preprocessing's float32
    (numpy) for every integer; float32 log1p would not (numpy's and torch's
    differ on many)."""
    from data_tools.criteo_text import dense_log1p as numpy_log1p
    from recsys_cli.export import dense_log1p as torch_log1p

    x = np.concatenate([np.arange(-3, 1 << 22), np.random.default_rng(0).integers(0, 1 << 62, 1 << 18),
                        [2**63 - 1, -(2**63)]]).astype(np.int64)
    assert torch.equal(torch_log1p(torch.from_numpy(x)), torch.from_numpy(numpy_log1p(x)))
    small = np.arange(1 << 22)
    assert (np.log1p(small.astype(np.float32)) != torch.log1p(torch.from_numpy(small).float()).numpy()).any()


@pytest.mark.parametrize("mode", ["vocabulary", "hash"])
def test_raw_ids_map_like_the_vocabulary(trained, mode):
    """The artifact's mapping (torch) == data_tools.vocab's lookup (numpy) on
    known, unknown, boundary and missing values."""
    from data_tools.vocab import Vocabulary, load_vocabulary
    from recsys_cli.export import RawIds

    vocab = load_vocabulary(trained["data"]) if mode == "vocabulary" else Vocabulary(
        [f"C{i}" for i in range(1, 27)], "hash", hash_buckets=1001)
    rng = np.random.default_rng(1)
    n = 4000
    raw = rng.integers(0, 1 << 32, (n, 26), dtype=np.int64)
    raw[:8] = [0], [1], [2**32 - 1], [2**32 - 2], [1000], [999], [12345], [2**31]
    if mode == "vocabulary":
        for f, t in enumerate(vocab.tables):  # half the rows: values with an id
            raw[8:n // 2, f] = rng.choice(np.asarray(t.values), n // 2 - 8)
    missing = rng.random((n, 26)) < 0.1
    expected = np.zeros((n, 26), dtype=np.int64)
    for f in range(26):
        expected[~missing[:, f], f] = vocab.lookup(f, raw[~missing[:, f], f].astype(np.uint32))
    mapping = RawIds(mode, 26, vocab.tables, vocab.hash_buckets)
    got = mapping(torch.from_numpy(np.where(missing, -1, raw)))
    assert torch.equal(got, torch.from_numpy(expected))
    assert (expected[~missing] > 0).mean() > (0.4 if mode == "vocabulary" else 0.99)


def test_export_round_trip(trained, tmp_path, one_compute_thread):
    from recsys_cli.export import ExportConfig, export, load_metadata

    dense, ids = val_inputs(trained)  # raw values: the artifact maps them itself
    reference = torch.sigmoid(trained["logits"])
    sizes, diffs = {}, {}
    for precision in ("fp32", "fp16", "int8", "int4"):
        out = tmp_path / f"model-{precision}.pt2"
        with warnings.catch_warnings():  # fp32 printed torch's "No complete tensor found in the group!"
            warnings.simplefilter("error")
            r = export(ExportConfig(checkpoint=str(trained["run"]), convert=precision, output=str(out)))
        assert r["bytes"] == out.stat().st_size and not list(tmp_path.glob(".*tmp*"))
        model = torch.export.load(str(out)).module()  # torch alone
        p = model(dense, ids)
        assert p.dtype == torch.float32 and p.shape == (len(dense),) and not p.requires_grad
        # any batch size runs (the last bits may differ: a GEMM's rounding depends on its row count)
        torch.testing.assert_close(model(dense[:1], ids[:1]), p[:1], rtol=1e-5, atol=1e-6)
        sizes[precision] = r["table_bytes"]
        if precision == "fp32":
            assert torch.equal(p, reference)
        else:
            diffs[precision] = (p - reference).abs().max().item()
            assert 0 < diffs[precision] <= EXPORT_TOLERANCE[precision], diffs
        meta = load_metadata(out)
        assert meta["mapping"] == "vocabulary"
        assert meta["precision"] == precision and meta["features"] == trained["trainer"].state_dict()["features"]
    dim, rows = 16, sum(trained["trainer"].state_dict()["features"].values())
    assert sizes == {"fp32": rows * dim * 4, "fp16": rows * dim * 2, "int8": rows * (dim + 4),
                     "int4": rows * (dim // 2 + 4)}


def test_module_format_scores_like_the_pt2(trained, tmp_path, one_compute_thread):
    """format=module (torch.save, rebuilt from recsys's classes) == the .pt2
    program, bit for bit, fp32 and int8; load_scorer reads both formats, and
    the metadata is the same dict."""
    import zipfile

    from recsys_cli.export import ExportConfig, export, load_metadata, load_scorer

    dense, ids = val_inputs(trained)
    for precision in ("fp32", "int8"):
        pt2, mod = tmp_path / f"m-{precision}.pt2", tmp_path / f"m-{precision}.scorer.pt"
        export(ExportConfig(checkpoint=str(trained["run"]), convert=precision, output=str(pt2)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            r = export(ExportConfig(checkpoint=str(trained["run"]), convert=precision, format="module",
                                    output=str(mod)))
        assert r["bytes"] == mod.stat().st_size and not list(tmp_path.glob(".*tmp*"))
        torch.load(mod, weights_only=True)  # no pickled code
        assert not any("archive_format" in n for n in zipfile.ZipFile(mod).namelist())
        program = torch.export.load(str(pt2)).module()(dense, ids)
        scorer = load_scorer(mod)
        p = scorer(dense, ids)
        assert p.dtype == torch.float32 and not p.requires_grad
        assert torch.equal(p, program)
        assert torch.equal(load_scorer(pt2, trust_program=True)(dense, ids), program)
        assert load_metadata(mod) == load_metadata(pt2)
        if precision == "fp32":
            assert torch.equal(p, torch.sigmoid(trained["logits"]))
    # the default name says the format
    r = export(ExportConfig(checkpoint=str(trained["run"]), convert="int8", format="module"))
    assert Path(r["output"]) == trained["run"] / "model-int8.scorer.pt"
    Path(r["output"]).unlink()
    with pytest.raises(UserError, match="format='onnx' is not one of pt2, module"):
        export(ExportConfig(checkpoint=str(trained["run"]), format="onnx"))


def test_module_format_loads_without_torch_export_reader(trained, tmp_path):
    """Loading and calling a format=module artifact imports neither torch's
    export reader (torch._dynamo, torch._export.serde) nor hydra or pyarrow."""
    import sys

    from recsys_cli.export import ExportConfig, export

    mod = tmp_path / "m.scorer.pt"
    export(ExportConfig(checkpoint=str(trained["run"]), convert="int8", format="module", output=str(mod)))
    code = (
        "import sys, torch\n"
        "from recsys_cli.export import load_scorer\n"
        "m = load_scorer(sys.argv[1])\n"
        "p = m(torch.zeros(3, 13, dtype=torch.int64), torch.full((3, 26), -1, dtype=torch.int64))\n"
        "assert p.shape == (3,)\n"
        "print(sorted(n for n in ('torch._dynamo', 'torch._export.serde', 'hydra', 'omegaconf', 'pyarrow') "
        "if n in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code, str(mod)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_damaged_artifact_is_one_line(trained, tmp_path):
    from recsys_cli.export import ExportConfig, export, load_metadata, load_scorer

    mod, pt2 = tmp_path / "m.scorer.pt", tmp_path / "m.pt2"
    export(ExportConfig(checkpoint=str(trained["run"]), convert="int8", format="module", output=str(mod)))
    export(ExportConfig(checkpoint=str(trained["run"]), convert="int8", output=str(pt2)))
    flipped = bytearray(mod.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF  # inside a table: torch.load alone would read it silently
    flipped_pt2 = bytearray(pt2.read_bytes())
    flipped_pt2[len(flipped_pt2) // 2] ^= 0xFF
    foreign = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    cases = {"flipped.scorer.pt": bytes(flipped), "flipped.pt2": bytes(flipped_pt2),
             "short.scorer.pt": mod.read_bytes()[: mod.stat().st_size // 2], "text.pt2": b"not a model\n",
             "other.pt": foreign.read_bytes()}
    for name, data in cases.items():
        bad = tmp_path / name
        bad.write_bytes(data)
        for read in (lambda f: load_scorer(f, trust_program=True), load_metadata):
            with pytest.raises(UserError) as e:
                read(bad)
            assert str(bad) in str(e.value) and len(str(e.value).splitlines()) == 1, (name, str(e.value))
    with pytest.raises(UserError, match="does not exist"):
        load_scorer(tmp_path / "missing.pt2")
    # A .pt2 runs code it holds when loaded: only on the caller's word.
    with pytest.raises(UserError, match=f"^{pt2} is a torch.export program, whose loading runs code it holds"):
        load_scorer(pt2)


@pytest.mark.parametrize("placement,precision,interaction", [("lookahead", "int8", "dot"), ("uvm", "fp16", "dot"),
                                                             ("cache", "int4", "dot"), ("device", "fp32", "dcn")])
def test_predict_any_placement_and_precision(trained, tmp_path, placement, precision, interaction):
    """A checkpoint of any placement and precision scores like a trainer that
    resumed from it (its tables as saved, caches empty), bit for bit."""
    from omegaconf import OmegaConf

    def cfg(**kw):
        c = config(tmp_path / "cache", dataset__path=str(trained["data"]), trainer__max_steps=30,
                   trainer__batch_size=64, trainer__eval_batch_size=128, trainer__device="cpu",
                   trainer__checkpoint_dir=str(tmp_path / "ck"), model__interaction=interaction, model__dcn_rank=8,
                   **kw)
        c.placement = OmegaConf.merge(c.placement, {"kind": placement, "cache_ratio": 0.2})
        c.precision = OmegaConf.merge(c.precision, {"kind": precision})
        return c

    Trainer(cfg()).fit()
    from recsys_cli.checkpoints import find_checkpoint, load_checkpoint

    resumed = Trainer(cfg(trainer__resume=str(tmp_path / "ck")))
    # the tables as saved, no cache: a resume also restores the cache's fp32 rows, which predict does not use
    resumed.embeddings.load_table_state(load_checkpoint(find_checkpoint(tmp_path / "ck"))["tables"])
    ref, _ = resumed.predictions("val")
    loaded = load_model(tmp_path / "ck", device="cpu")
    assert loaded.tables.precision == precision
    got = torch.cat([lg for lg, _ in dataset_logits(loaded, trained["data"], ["val"], 128)])
    assert torch.equal(got, ref)


def test_exported_ids_past_a_table_are_an_error_naming_the_feature(tmp_path):
    """A synthetic dataset's artifact takes ids as they are: an id past a
    feature's table is refused naming the feature (format=module: and the id),
    as the loader refuses such a dataset, not a bare IndexError; the last row
    of every table still scores."""
    from recsys_cli.export import ExportConfig, export, load_scorer

    cfg = config(tmp_path / "cache", trainer__max_steps=5, trainer__checkpoint_dir=str(tmp_path / "run" / "checkpoints"),
                 trainer__device="cpu")
    (tmp_path / "run").mkdir()
    Trainer(cfg, run_dir=tmp_path / "run").fit()
    loaded = load_model(tmp_path / "run", device="cpu")
    sizes = list(loaded.features.values())
    dense = torch.zeros(2, 13, dtype=torch.int64)
    last = torch.tensor([[n - 1 for n in sizes], [0] * len(sizes)])  # each table's last row, then its first
    past = last.clone()
    past[1, 3] = sizes[3]
    name = list(loaded.features)[3]
    expected = torch.sigmoid(loaded.logits_onehot(torch.zeros(2, 13), last))
    for fmt, error, message in (("module", ValueError, f"categorical {name}: id {sizes[3]} (row 1) is outside "
                                                       f"[0, {sizes[3]})"),
                                ("pt2", RuntimeError, f"categorical {name}: an id outside [0, {sizes[3]})")):
        out = tmp_path / f"model.{fmt}"
        assert export(ExportConfig(checkpoint=str(tmp_path / "run"), format=fmt, output=str(out)))["mapping"] == "ids"
        model = load_scorer(out, trust_program=True)
        assert torch.equal(model(dense, last), expected)
        with pytest.raises(error, match=re.escape(message)):
            model(dense, past)


def test_a_terabyte_dataset_is_scored_in_input_order(trained, tmp_path):
    """split_by=terabyte halves the last day into test, then val: predict on the
    dataset writes the rows in that order, as on the raw days (it wrote val
    before test, the manifest's order)."""
    rows = trained["val_rows"][:90]
    days = tmp_path / "days"
    days.mkdir()
    write_raw(days / "day_0", rows[:50])
    write_raw(days / "day_1", rows[50:])
    preprocess(CriteoConfig(input=str(days / "day_*"), output=str(tmp_path / "tb"), split_by="terabyte",
                            vocab=str(trained["data"]), progress=False))
    base = dict(checkpoint=str(trained["run"]), progress=False, device="cpu", batch_size=1)
    predict(PredictConfig(input=str(tmp_path / "tb"), output=str(tmp_path / "dataset.csv"), **base))
    predict(PredictConfig(input=str(days / "day_*"), output=str(tmp_path / "raw.csv"), **base))
    assert (tmp_path / "dataset.csv").read_text() == (tmp_path / "raw.csv").read_text()


def test_evaluate_again_keeps_the_users_files(trained, tmp_path):
    """A rerun into an earlier evaluation's directory replaces evaluate's own
    files only (it removed the whole directory, and a user's notes in it)."""
    from recsys_cli.evaluate import EvaluateConfig, evaluate

    out = tmp_path / "eval"
    base = dict(checkpoint=str(trained["run"]), split="val", output=str(out), progress=False, device="cpu")
    evaluate(EvaluateConfig(**base))
    (out / "notes.txt").write_text("mine")
    (out / "evaluation.json").write_text("{}")
    result = evaluate(EvaluateConfig(**base, plots=False))
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["evaluation.json", "notes.txt"]  # no stale plots
    assert result["split"] == "val" and not list(tmp_path.glob(".eval.tmp-*"))


def test_an_output_that_is_a_file_read_is_refused_and_the_file_kept(trained, tmp_path, capsys, monkeypatch):
    """predict output= its raw input replaced the user's rows with the
    predictions; output= a dataset's manifest or shard, or export output= the
    checkpoint, replaced what the command had read. Each is one line, exit 2,
    and the file stays as it was; a new file beside a dataset's is fine."""
    import shutil

    raw = write_raw(tmp_path / "rows.txt", trained["val_rows"][:20])
    data = tmp_path / "data"
    shutil.copytree(trained["data"], data)
    checkpoint = next((trained["run"] / "checkpoints").glob("step-*.pt"))
    cases = [
        (["predict", f"checkpoint={trained['run']}", f"input={raw}", f"output={raw}"], raw, "is the input"),
        (["predict", f"checkpoint={trained['run']}", f"input={data}", f"output={data / 'manifest.json'}"],
         data / "manifest.json", "is a file of the input dataset"),
        (["predict", f"checkpoint={trained['run']}", f"input={raw}", f"vocab={data}",
          f"output={data / 'vocab' / 'C1.ids.npy'}"], data / "vocab" / "C1.ids.npy", "is a file of the vocabulary dataset"),
        (["predict", f"checkpoint={trained['run']}", f"input={raw}", f"output={checkpoint}"], checkpoint,
         "is the checkpoint"),
        (["export", f"checkpoint={trained['run']}", f"output={checkpoint}", "format=module"], checkpoint,
         "is the checkpoint"),
    ]
    monkeypatch.setenv("COLUMNS", "400")
    for argv, kept, needle in cases:
        before = kept.read_bytes()
        code, stderr = in_process([*argv, "progress=false"] if argv[0] == "predict" else argv, capsys)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr  # export says what it loaded first
        assert needle in errors[0] and "that `recsys" in errors[0], stderr
        assert kept.read_bytes() == before
    code, stderr = in_process(["predict", f"checkpoint={trained['run']}", f"input={data}", "split=val",
                               f"output={data / 'preds.csv'}", "progress=false", "device=cpu"], capsys)
    assert code == 0 and (data / "preds.csv").is_file(), stderr


@pytest.mark.parametrize("options, message", [
    (["id_start=0", "id_name=a,b"], "id_name='a,b': a CSV column name must be non-empty, without a comma"),
    (['prob_name=p"'], "prob_name='p\"': a CSV column name"),
    (["id_start=0", "id_name=Predicted"], "id_name and prob_name are both 'Predicted'"),
])
def test_a_column_name_the_csv_cannot_hold_is_refused(trained, tmp_path, capsys, monkeypatch, options, message):
    """id_name=a,b wrote the header `a,b,Predicted` over two-column rows: a CSV
    that does not read back. Now one line, exit 2, before anything is written."""
    raw = write_raw(tmp_path / "rows.txt", trained["val_rows"][:5])
    monkeypatch.setenv("COLUMNS", "400")
    code, stderr = in_process(["predict", f"checkpoint={trained['run']}", f"input={raw}",
                               f"output={tmp_path / 'p.csv'}", "progress=false", *options], capsys)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "p.csv").exists()


def test_what_a_killed_writer_left_is_removed_by_the_next(trained, tmp_path):
    """predict, evaluate and export build their output as `.<name>.tmp-<pid>`
    beside it; one killed with SIGKILL left that (a partial CSV) for good. The
    next writer of the same output removes it; other outputs' are left alone."""
    from recsys_cli.evaluate import EvaluateConfig, evaluate

    raw = write_raw(tmp_path / "rows.txt", trained["val_rows"][:10])
    (tmp_path / ".p.csv.tmp-999999").write_text("Predicted\n0.5\n")  # a partial CSV
    (tmp_path / ".other.csv.tmp-999999").write_text("not this output's")
    (tmp_path / ".eval.tmp-999999").mkdir()
    (tmp_path / ".eval.tmp-999999" / "evaluation.json").write_text("{")
    predict(PredictConfig(checkpoint=str(trained["run"]), input=str(raw), output=str(tmp_path / "p.csv"),
                          progress=False, device="cpu"))
    evaluate(EvaluateConfig(checkpoint=str(trained["run"]), split="val", output=str(tmp_path / "eval"),
                            progress=False, device="cpu", plots=False))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".other.csv.tmp-999999"]


def test_a_list_of_raw_files_is_scored_in_order(trained, tmp_path, capsys):
    """input=[a,b] (preprocess's way of naming several files) was OmegaConf's
    "Cannot convert 'ListConfig' to string"; now the files are scored in the
    order given, as one file holding both."""
    a = write_raw(tmp_path / "a.txt", trained["val_rows"][:7])
    b = write_raw(tmp_path / "b.txt.gz", trained["val_rows"][7:20], gz=True)
    both = write_raw(tmp_path / "both.txt", trained["val_rows"][:20])
    base = ["predict", f"checkpoint={trained['run']}", "progress=false", "device=cpu", "batch_size=4"]
    code, stderr = in_process([*base, f"input=[{a},{b}]", f"output={tmp_path / 'list.csv'}"], capsys)
    assert code == 0, stderr
    code, stderr = in_process([*base, f"input={both}", f"output={tmp_path / 'one.csv'}"], capsys)
    assert code == 0, stderr
    assert (tmp_path / "list.csv").read_text() == (tmp_path / "one.csv").read_text()
    assert len((tmp_path / "list.csv").read_text().splitlines()) == 21


def test_an_unlabelled_line_among_labelled_ones_gets_the_scorers_advice(trained, tmp_path, capsys, monkeypatch):
    """A 39-field line where predict (or raw_inputs) reads labelled lines was
    told preprocess's advice ("preprocess builds training data ...; to score
    it: recsys predict ..."), to a user who was scoring it."""
    from recsys_cli.export import raw_inputs

    labelled_rows = write_raw(tmp_path / "a.txt", trained["val_rows"][:3])
    unlabelled_rows = write_raw(tmp_path / "b.txt", [r[1:] for r in trained["val_rows"][3:6]])
    monkeypatch.setenv("COLUMNS", "400")
    code, stderr = in_process(["predict", f"checkpoint={trained['run']}", f"input=[{labelled_rows},{unlabelled_rows}]",
                               f"output={tmp_path / 'p.csv'}", "progress=false"], capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert f"{unlabelled_rows} line 1: expected 40 tab-separated fields, found 39: the line looks unlabelled" in stderr
    assert "score labelled and unlabelled lines separately" in stderr and "preprocess" not in stderr, stderr
    lines = [*labelled_rows.read_text().splitlines(), unlabelled_rows.read_text().splitlines()[0]]
    with pytest.raises(ValueError, match=r"^line 4: .*found 39: the line looks unlabelled") as error:
        raw_inputs(lines)
    assert "preprocess" not in str(error.value)


def test_a_scorer_record_without_metadata_is_one_line(tmp_path):
    """load_metadata on a format=module record that lacks its metadata was a
    KeyError; load_scorer's record checks already name such a file."""
    from recsys_cli.export import SCORER_FORMAT, load_metadata

    path = tmp_path / "m.scorer.pt"
    torch.save({"format": SCORER_FORMAT, "state_dict": {}}, path)
    with pytest.raises(UserError, match=rf"^{path} holds no recsys metadata"):
        load_metadata(path)
