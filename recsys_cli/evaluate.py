"""`recsys evaluate checkpoint=RUN_OR_FILE [input=DIR] [split=test] [output=DIR]`

Scores a split of a labelled dataset (default: the checkpoint's own dataset,
its test split, else val) with the checkpoint and writes, into output
(default: <run dir>/evaluate-<split>):

  evaluation.json   AUC, log loss, accuracy, normalized entropy (log loss
                    over the entropy of the observed click rate: 1.0 is the
                    base rate, lower is better), calibration (mean predicted
                    over observed click rate), calibration bins (predicted vs
                    observed rate per tenth of the predicted probability),
                    and the ROC curve's points
  roc.png           the ROC curve
  calibration.png   observed vs predicted click rate per bin, with the rows in each bin

The metrics are the trainer's (recsys_cli/train/metrics.py), computed from
the same logits: evaluating a finished run's checkpoint on its val split
gives the val AUC of its summary. convert= scores with the tables
converted (e.g. int8, to see what an int8 export costs). The directory is
built under a temporary name and renamed into place; over an earlier
evaluation only these files are replaced, and other files there stay.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch

from recsys_cli.config import DeviceChoice, PrecisionKind, Range, check_ranges
from recsys_cli.errors import UserError, say
from recsys_cli.locks import check_writable, locked_output
from recsys_cli.options import CONVERT_RENAMED, Renamed, plain_word, help_text, parse_options, require, wants_help

RESULT = "evaluation.json"


@dataclass
class EvaluateConfig:
    checkpoint: Optional[str] = None  # a .pt file, a checkpoint directory or a run directory (required)
    input: Optional[str] = None  # the labelled dataset directory to score (default: the checkpoint's own)
    split: Optional[str] = None  # the split to score (default: test, else val)
    output: Optional[str] = None  # the directory to write (default: <run dir>/evaluate-<split>)
    bins: int = 10  # calibration bins over the predicted probability
    batch_size: Optional[int] = None  # rows per batch, >= 1 (unset: the run's trainer.eval_batch_size)
    device: DeviceChoice = DeviceChoice.auto  # auto (cuda when there is one) | cpu | cuda
    # Score with the tables converted to fp32 | fp16 | int8 | int4 (default: as trained).
    convert: Optional[PrecisionKind] = None
    plots: bool = True  # write roc.png and calibration.png (false: evaluation.json only)
    progress: bool = True  # a progress bar on a terminal


# The numbers the options may hold (config.Range, as train's keys): 0 is not a count, never "the default".
RANGES = {"bins": Range(1), "batch_size": Range(1, unset=True)}


def metrics(logits: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> dict:
    from recsys_cli.train.metrics import binary_metrics, calibration_bins, roc_curve

    probs = torch.sigmoid(logits.double())
    out: dict = dict(binary_metrics(logits, labels))  # auc, logloss, normalized_entropy, accuracy, calibration...
    out["calibration_bins"] = calibration_bins(labels, probs, bins)
    out["roc"] = roc_curve(logits, labels)
    return out


def _against_diagonal(xs, ys, label: str, legend: Literal["lower right", "upper left"], xlabel: str, ylabel: str,
                      title: str, point_notes: list[str] | None = None, **style):
    """One curve on the unit square beside the diagonal (chance for ROC,
    perfect calibration for the calibration curve); `point_notes` are
    written beside the curve's points."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 5))
    ax = fig.add_subplot()
    ax.plot(xs, ys, label=label, **style)
    for x, y, note in zip(xs, ys, point_notes or []):
        ax.annotate(note, (x, y), fontsize=7, xytext=(-5, 5), textcoords="offset points", ha="right", color="dimgrey",
                    bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    ax.plot([0, 1], [0, 1], linestyle=":", color="grey")
    ax.set(xlabel=xlabel, ylabel=ylabel, xlim=(0, 1), ylim=(0, 1), title=title)
    ax.legend(loc=legend)
    return fig


def calibration_figure(result: dict):
    """Observed against predicted click rate per bin, each point labelled
    with the rows in its bin (a point of 12 rows is noise, one of 1M is not)."""
    full = [b for b in result["calibration_bins"] if b["rows"]]
    return _against_diagonal([b["predicted"] for b in full], [b["observed"] for b in full],
                             f"calibration {result['calibration']:.3f}\n(beside each point: rows in its bin)",
                             "upper left", "mean predicted click rate (bin)", "observed click rate",
                             f"calibration: {result['split']}, NE {result['normalized_entropy']:.4f}",
                             point_notes=[f"{b['rows']:,}" for b in full], marker="o")


def plot(result: dict, directory: Path) -> list[Path]:
    roc = _against_diagonal(result["roc"]["fpr"], result["roc"]["tpr"], f"AUC {result['auc']:.4f}", "lower right",
                            "false positive rate", "true positive rate",
                            f"ROC: {result['split']} ({result['samples']:,} rows)")
    written = []
    for fig, name in ((roc, "roc.png"), (calibration_figure(result), "calibration.png")):
        fig.savefig(directory / name, dpi=110, bbox_inches="tight")
        written.append(directory / name)
    return written


PLOTS = ("roc.png", "calibration.png")


def _replace_own_files(tmp: Path, output: Path) -> None:
    """Move what `tmp` holds into an earlier evaluation's directory, replacing
    only the files evaluate writes (a plot this run did not draw is removed,
    not left stale): anything else a user keeps there stays. evaluation.json
    comes last, each file by one rename."""
    for name in PLOTS:
        if (tmp / name).exists():
            os.replace(tmp / name, output / name)
        else:
            (output / name).unlink(missing_ok=True)
    os.replace(tmp / RESULT, output / RESULT)
    tmp.rmdir()


def evaluate(cfg: EvaluateConfig, console=None) -> dict:
    with contextlib.ExitStack() as hold:  # the output's lock, once the output is known (locks.py)
        return _evaluate(cfg, console, hold)


def _evaluate(cfg: EvaluateConfig, console, hold: contextlib.ExitStack) -> dict:
    from rich.console import Console

    from recsys_cli.inference import load_model
    from recsys_cli.predict import RowProgress, check_dataset, dataset_logits
    from recsys_cli.train.metrics import SplitPredictions, write_json_atomic

    console = console or Console(stderr=True, highlight=False)
    checkpoint = require(cfg.checkpoint, "checkpoint", "evaluate", "a run directory or a .pt file")
    check_ranges(cfg, RANGES)
    if cfg.output:  # an unwritable output is said before the checkpoint loads
        check_writable(Path(cfg.output), "output")
    loaded = load_model(checkpoint, str(cfg.device), plain_word(cfg.convert))
    dataset = Path(cfg.input).expanduser() if cfg.input else loaded.dataset_dir
    if dataset is None:
        raise UserError(f"{loaded.checkpoint} does not say which dataset it was trained on: give input=DIR")
    manifest = check_dataset(loaded, dataset)
    if not manifest.labelled:
        raise UserError(f"{dataset} has no labels (preprocessed with labels=false): use `recsys predict` on it")
    split = cfg.split
    if split is None:
        split = next((s for s in ("test", "val") if s in manifest.splits and manifest.splits[s].rows), None)
        if split is None:
            raise UserError(f"{dataset} has no test or val rows: give split= (splits: {', '.join(manifest.splits)})")
    if split not in manifest.splits or not manifest.splits[split].rows:
        raise UserError(f"split {split!r} of {dataset} is missing or empty (splits: {', '.join(manifest.splits)})")
    batch_size = cfg.batch_size if cfg.batch_size is not None else int(loaded.config["trainer"]["eval_batch_size"])
    run_dir = loaded.checkpoint.parent.parent if loaded.checkpoint.parent.name == "checkpoints" else loaded.checkpoint.parent
    output = Path(cfg.output).expanduser() if cfg.output else run_dir / f"evaluate-{split}"
    hold.enter_context(locked_output(output, "output", "evaluate"))  # one writer; an unwritable place said now
    if output.exists() and not (output / RESULT).is_file() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"output {output} exists and was not written by `recsys evaluate`; refusing to replace it")

    predictions = SplitPredictions(manifest.splits[split].rows)
    with RowProgress(cfg.progress, manifest.splits[split].rows, "rows") as progress:
        for lg, lb in dataset_logits(loaded, dataset, [split], batch_size, progress.advance):
            predictions.add(lg, lb)
    logits, labels = predictions.result()
    result = {"checkpoint": str(loaded.checkpoint), "dataset": str(dataset), "split": split,
              "step": loaded.state.get("step"), "precision": loaded.tables.precision, **metrics(logits, labels, cfg.bins)}

    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_json_atomic(tmp / RESULT, result)
        notes = []
        if cfg.plots:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                notes.append("plots skipped: matplotlib is not installed (pip install matplotlib, or "
                             "pip install '.[plots]' in recsys's checkout)")
            else:
                plot(result, tmp)
        if output.is_dir() and any(output.iterdir()):
            _replace_own_files(tmp, output)
        else:
            os.replace(tmp, output)  # absent, or an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fmt = lambda x: "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"  # noqa: E731
    say(console, f"{split} ({result['samples']:,} rows, tables {result['precision']}): "
                  f"AUC {fmt(result['auc'])}, log loss {fmt(result['logloss'])}, NE {fmt(result['normalized_entropy'])}, "
                 f"accuracy {fmt(result['accuracy'])}, calibration {fmt(result['calibration'])}", "evaluate")
    for note in notes:
        say(console, note)
    say(console, f"wrote {output}")
    return json.loads((output / RESULT).read_text())


EXAMPLES = ("recsys evaluate checkpoint=outputs/run",
            "recsys evaluate checkpoint=outputs/run/checkpoints split=val convert=int8 output=eval-int8")
# Old spellings (issue 42 item 4): dataset= picks a config group in `recsys train`.
RENAMED = (Renamed("dataset", "input", "dataset= picks a config group in `recsys train`; input= is the directory "
                                       "read, as in `recsys predict`"), CONVERT_RENAMED)


def run_evaluate(overrides: list[str]) -> None:
    if wants_help(overrides):
        print(help_text("evaluate", __doc__ or "", EXAMPLES, schema=EvaluateConfig))
        return
    evaluate(parse_options(EvaluateConfig, overrides, "evaluate", RENAMED))
