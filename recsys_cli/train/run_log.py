"""The run's log lines: progress a batch job can read.

A terminal gets the rich progress bar (progress.py); a log file and a
redirected stdout get lines instead, one every `trainer.log_every` steps
(step, epoch, loss, samples/s, ETA) and one per evaluation. The lines go to
the logger LOGGER, which configs/train.yaml sends to Hydra's job log file
(`<run dir>/app.log`) only, and, when stdout is not a terminal, to stdout
through the run's console (so they interleave with its other output in
order). A Trainer built outside Hydra (tests, a script) has no file
handler: the lines then go to stdout alone, or nowhere on a terminal.
"""

from __future__ import annotations

import logging
import time

from recsys_cli.errors import say

LOGGER = "recsys_cli.train.run"


def duration(seconds: float) -> str:
    """H:MM:SS, as rich's bar shows it."""
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class RunLog:
    """Writes a line to the log file and, off a terminal, to stdout."""

    def __init__(self, console, enabled: bool = True) -> None:
        self.logger = logging.getLogger(LOGGER)
        self.enabled = enabled
        self.console = console if enabled and console is not None and not console.is_terminal else None

    def line(self, message: str) -> None:
        if not self.enabled:
            return
        self.logger.info(message)
        if self.console is not None:
            self.console.print(message, soft_wrap=True, markup=False, highlight=False)

    def start_line(self, message: str, console) -> None:
        """A start-up line (a config note): to the log file, and on `console`
        (a terminal or not, trainer.progress or not) as the run's other
        start-up lines are printed (errors.say)."""
        if not self.enabled:
            return
        self.logger.info(message)
        if console is not None:
            say(console, message, soft_wrap=True, highlight=False)


class StepLines:
    """The training loop's lines: the rate since the previous line, and the
    ETA from the steps this process has run so far (a resumed run's own)."""

    def __init__(self, log: RunLog, total_steps: int, start_step: int) -> None:
        self.log = log
        self.total = total_steps
        self.start_step = start_step
        self.started = time.perf_counter()

    def step(self, step: int, epoch: int, loss: float, rate: float) -> None:
        done = step - self.start_step
        elapsed = time.perf_counter() - self.started
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        self.log.line(f"step {step}/{self.total} ({100 * step / self.total:.0f} %) epoch {epoch} "
                      f"loss {loss:.4f} {rate:,.0f} samples/s elapsed {duration(elapsed)} "
                      f"ETA {duration(eta) if eta == eta else '-'}")
