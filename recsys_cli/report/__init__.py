"""`recsys report input=DIR [output=DIR] [plots=false]`: a table, a CSV file and plots of a run or a sweep.

input is one run directory (summary.json, metrics.jsonl, .hydra/overrides.yaml)
or a Hydra multirun directory; every summary.json below it is one run. The
report has one row per run: the run's overrides, validation AUC and log loss,
steady-state training samples/s (after the warm-up steps, evaluation and
checkpoints left out) beside wall-clock seconds, embedding bytes on the device and in host memory, cache hit rate,
dedup ratio and seconds per phase; a run with tables on disk adds the disk
tier's figures, a run with sharded tables (summary.json's "sharding") its
bytes, expected lookups and shard count per rank and the imbalance. It
prints that as tables, writes it to report.csv and draws:

  throughput.png      steady-state samples/s per run, coloured by placement / precision
  auc.png             validation AUC per run, same colours
  phase_seconds.png   seconds per phase per run, stacked
  cache_overhead.png  the cache's cost per step against lookahead window and
                      cache size (only when some run uses a cache)

Everything is written to a temporary name and renamed. A summary.json that
cannot be read is reported as skipped, not fatal. matplotlib is imported only
when plotting.

  runs.py     reading run directories, labels, one row of numbers per run
  tables.py   the console tables and report.csv
  plots.py    the PNGs
  (here)      the command: find the runs, print, write
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from recsys_cli.errors import UserError, say
from recsys_cli.locks import locked_output
from recsys_cli.report.plots import PLOT_NAMES
from recsys_cli.report.runs import Run, find_runs, load_run, report_rows, run_labels
from recsys_cli.report.tables import CSV_NAME, console_tables, write_csv

__all__ = ["CSV_NAME", "PLOT_NAMES", "Report", "ReportConfig", "Run", "build_report", "find_runs", "load_run",
           "report_rows", "run_labels", "run_report"]


# --- the command ----------------------------------------------------------------------------------
@dataclass
class Report:
    root: Path
    out: Path
    runs: list[Run]
    skipped: list[tuple[Path, str]]
    rows: list[dict]
    csv: Path
    plots: list[Path]
    notes: list[str]


def build_report(root: Path | str, out: Path | str | None = None, console=None, plots: bool = True) -> Report:
    """Find the runs below `root`, print the tables to `console` (if any),
    write report.csv and the plots into `out` (default: root)."""
    root = Path(root)
    runs, skipped = find_runs(root)
    if not runs:
        names = "; ".join(f"{path}: {why}" for path, why in skipped)
        raise UserError(f"recsys report: no readable summary.json in {root}: {names}")
    labels = run_labels([r.overrides for r in runs], [r.rel if r.rel != "." else root.name for r in runs])
    for run, label in zip(runs, labels):
        run.label = label
    out = Path(out) if out is not None else root
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"recsys report: cannot create the output directory {out}: {e.strerror}") from None
    rows = report_rows(runs)
    notes = [n for r in runs for n in r.notes]
    if console is not None:
        for table in console_tables(rows, root, console.width):
            console.print(table)
    csv_path = out / CSV_NAME
    # One writer per output (locks.py): two reports into one directory are not mixed.
    with locked_output(csv_path, "report output", "report", "output=DIR"):
        try:
            write_csv(csv_path, rows)
            written: list[Path] = []
            if plots:
                try:
                    import matplotlib  # noqa: F401
                except ImportError:
                    notes.append("plots skipped: matplotlib is not installed (pip install matplotlib, or "
                                 "pip install '.[plots]' in recsys's checkout)")
                else:
                    from recsys_cli.report.plots import make_plots

                    written, plot_notes = make_plots(runs, out)
                    notes.extend(plot_notes)
        except OSError as e:  # a read-only file system as well as no permission
            raise UserError(f"recsys report: cannot write into {out}: {e.strerror}") from None
    report = Report(root, out, runs, skipped, rows, csv_path, written, notes)
    if console is not None:
        for path, why in skipped:
            say(console, f"{path}: {why}", "skipped", "yellow", highlight=False)
        for note in notes:
            say(console, note, "note:", "yellow", highlight=False)
        say(console, f"wrote {csv_path}" + "".join(f"\nwrote {p}" for p in written), highlight=False)
    return report


@dataclass
class ReportConfig:
    input: Optional[str] = None  # a run directory, or a directory with runs below it (a sweep)
    output: Optional[str] = None  # where to write report.csv and the plots (default: input)
    plots: bool = True  # draw the plots (false: only the tables and report.csv)


PURPOSE = "Table, CSV (report.csv) and plots of a run directory or a sweep (multirun) directory."
EXAMPLES = ("recsys report input=outputs/2026-01-01/12-00-00",
            "recsys report input=multirun/2026-01-01/12-00-00 output=sweep-report plots=false")


def run_report(args: list[str]) -> None:
    """`recsys report input=DIR [output=DIR] [plots=false]`; the older
    `recsys report DIR [--out DIR] [--no-plots]` still works, with a deprecation line."""
    from rich.console import Console

    from recsys_cli.options import help_text, old_arguments, parse_options, require, wants_help

    if wants_help(args):
        print(help_text("report", PURPOSE, EXAMPLES, schema=ReportConfig))
        return
    cfg = parse_options(ReportConfig, old_arguments(args, "report", "input", flags={"--out": "output"},
                                                    switches={"--no-plots": "plots=false"}), "report")
    root = Path(require(cfg.input, "input", "report", "a run or sweep directory")).expanduser()
    console = Console()
    if not console.is_terminal:  # a file or a pipe: no reason to fold the tables to 80 columns
        console = Console(width=200)
    build_report(root, Path(cfg.output).expanduser() if cfg.output else None, console=console, plots=cfg.plots)
