"""What the validation results decide: the best checkpoint so far, early
stopping, and dlrm's AUC-threshold stop (Lightning's ModelCheckpoint and
EarlyStopping callbacks, dlrm's --mlperf-auc-threshold).

Every decision is made on a validation evaluation (`trainer.eval_every`
steps and the end of each epoch) from its metrics alone, and the state
behind them (the best value, the evaluations since it) is saved in every
checkpoint, so a resumed run decides as the uninterrupted one does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The metrics a validation record holds that a run may monitor, and which way is better.
MAXIMIZE = ("auc", "accuracy")
MINIMIZE = ("logloss", "normalized_entropy")
METRICS = MAXIMIZE + MINIMIZE


def monitor_mode(metric: str, mode: str | None) -> str:
    """The mode given, or for "auto" the metric's own direction (auc: max, logloss: min)."""
    if mode is not None and str(mode) != "auto":
        return str(mode)
    return "max" if metric in MAXIMIZE else "min"


@dataclass
class Decision:
    improved: bool  # the best value so far (keep_best saves this step's checkpoint as the best)
    stop: str | None  # why training stops after this evaluation, or None


class LoopControl:
    def __init__(self, tc) -> None:
        self.metric = str(tc.monitor)
        self.mode = monitor_mode(self.metric, tc.monitor_mode)
        self.min_delta = float(tc.early_stop_min_delta)
        self.patience = tc.early_stop_patience
        self.stop_at_auc = tc.stop_at_auc
        self.best: float | None = None
        self.best_step: int | None = None
        self.since_best = 0  # validation evaluations since the best one
        self.stopped: dict | None = None  # {"step", "reason"} once a rule stopped the run

    def better(self, value: float, than: float | None, delta: float = 0.0) -> bool:
        if not math.isfinite(value):
            return False
        if than is None:
            return True
        return value > than + delta if self.mode == "max" else value < than - delta

    def after_validation(self, step: int, metrics: dict) -> Decision:
        value = float(metrics[self.metric])
        improved = self.better(value, self.best)
        # Early stopping counts evaluations that did not beat the best by min_delta.
        if self.better(value, self.best, self.min_delta):
            self.since_best = 0
        else:
            self.since_best += 1
        if improved:
            self.best, self.best_step = value, step
        stop = None
        if self.stop_at_auc is not None and metrics["auc"] >= self.stop_at_auc:
            stop = f"validation AUC {metrics['auc']:.4f} reached trainer.stop_at_auc={self.stop_at_auc}"
        elif self.patience is not None and self.since_best >= self.patience:
            stop = (f"early stop: val {self.metric} has not improved by more than {self.min_delta:g} in "
                    f"{self.since_best} evaluations (trainer.early_stop_patience={self.patience}); "
                    f"best {self.best:.4f} at step {self.best_step}")
        if stop is not None:
            self.stopped = {"step": step, "reason": stop}
        return Decision(improved, stop)

    def state_dict(self) -> dict:
        return {"metric": self.metric, "mode": self.mode, "best": self.best, "best_step": self.best_step,
                "since_best": self.since_best, "stopped": self.stopped}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's state; one saved while monitoring another metric (or
        none, an older checkpoint) starts afresh."""
        if not state or state.get("metric") != self.metric or state.get("mode") != self.mode:
            return
        self.best, self.best_step, self.since_best = state["best"], state["best_step"], state["since_best"]
        self.stopped = None  # a resumed run trains on: the rule decides again at its next evaluation

    def report(self) -> dict:
        return {"monitor": self.metric, "mode": self.mode, "best": self.best, "best_step": self.best_step,
                "stopped": self.stopped}
