"""Where a run's metrics go: metrics.jsonl always (the record), TensorBoard too
with trainer.logger=tensorboard.

TensorBoard gets the same records as scalars, tagged by where they come
from: `train/loss`, `train/samples_per_second`, `train/hit_rate`,
`phase_seconds/<phase>` (cumulative), `val/auc`, `test/logloss`..., at the
record's step. torch.utils.tensorboard needs the `tensorboard` package, an
optional extra: pip install tensorboard, or pip install '.[tensorboard]' in
recsys's checkout.
"""

from __future__ import annotations

from pathlib import Path

from recsys_cli.errors import UserError
from recsys_cli.train.metrics import MetricsLog

LOGGERS = ("jsonl", "tensorboard")
# Installed from a clone (pip install .): the extra is named by the checkout's path, not by
# the project's name, which on PyPI may be someone else's package.
MISSING = ("trainer.logger=tensorboard needs the tensorboard package: pip install tensorboard (or, in "
           "recsys's checkout, pip install '.[tensorboard]'); trainer.logger=jsonl needs nothing")


def summary_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(MISSING) from None
    return SummaryWriter


def scalars(record: dict) -> dict[str, float]:
    """A metrics record's numbers as TensorBoard tags."""
    split = record.get("split")
    out: dict[str, float] = {}

    def add(prefix: str, d: dict) -> None:
        for k, v in d.items():
            if k in ("step", "split", "epoch") and prefix == (split or "train"):
                continue
            if isinstance(v, dict):
                add(k, v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:  # not nan
                out[f"{prefix}/{k}"] = float(v)

    add(split or "train", record)
    return out


class TensorBoardLog(MetricsLog):
    """metrics.jsonl plus TensorBoard event files in log_dir."""

    def __init__(self, path: Path | None, log_dir: Path) -> None:
        writer = summary_writer_class()  # fail before anything is opened
        super().__init__(path)
        self.writer = writer(log_dir=str(log_dir))

    def write(self, record: dict) -> None:
        super().write(record)
        step = int(record.get("step", 0))
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        super().close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def make_log(kind: str, run_dir: Path | None, is_main: bool = True) -> MetricsLog:
    path = run_dir / "metrics.jsonl" if run_dir and is_main else None
    if kind == "tensorboard":
        if path is None or run_dir is None:  # no run directory (or not rank 0): nothing is written, but check it would work
            summary_writer_class()
            return MetricsLog(None)
        return TensorBoardLog(path, run_dir / "tensorboard")
    return MetricsLog(path)
