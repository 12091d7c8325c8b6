"""`recsys report DIR [--out DIR]`: a table, a CSV file and plots of a run or a sweep.

DIR is one run directory (summary.json, metrics.jsonl, .hydra/overrides.yaml)
or a Hydra multirun directory; every summary.json below DIR is one run. The
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

import argparse
from dataclasses import dataclass
from pathlib import Path

from recsys_cli.errors import UserError, say
from recsys_cli.locks import locked_output
from recsys_cli.report.plots import PLOT_NAMES
from recsys_cli.report.runs import Run, find_runs, load_run, report_rows, run_labels
from recsys_cli.report.tables import CSV_NAME, console_tables, write_csv

__all__ = ["CSV_NAME", "PLOT_NAMES", "Report", "Run", "build_report", "find_runs", "load_run", "parser",
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
    with locked_output(csv_path, "report output", "report", "--out DIR"):
        try:
            write_csv(csv_path, rows)
            written: list[Path] = []
            if plots:
                try:
                    import matplotlib  # noqa: F401
                except ImportError:
                    notes.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a UserError, printed by the CLI without a traceback
        raise UserError(f"recsys report: {message}\n{self.format_usage().strip()}")


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="recsys report",
        description="Table, CSV (report.csv) and plots of a run directory or a sweep (multirun) directory.",
    )
    p.add_argument("dir", metavar="DIR", help="a run directory, or a directory with runs below it (a sweep)")
    p.add_argument("--out", metavar="DIR", default=None, help="where to write report.csv and the plots (default: DIR)")
    p.add_argument("--no-plots", action="store_true", help="only the tables and report.csv")
    return p


EXAMPLES = ("recsys report outputs/2026-01-01/12-00-00",
            "recsys report multirun/2026-01-01/12-00-00 --out sweep-report --no-plots")


def report_help() -> str:
    """`recsys report --help` in every command's layout (options.help_text),
    the arguments and their descriptions taken from the parser."""
    from recsys_cli.options import help_text

    p = parser()
    entries = []
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        metavar = str(action.metavar) if action.metavar else ""
        name = " ".join([*action.option_strings, metavar]).strip()
        entries.append((name, action.help or ""))
    return help_text("report", p.description or "", EXAMPLES, entries=entries,
                     usage="recsys report DIR [--out DIR] [--no-plots]")


def run_report(args: list[str]) -> None:
    """`recsys report DIR [--out DIR] [--no-plots]`."""
    from rich.console import Console

    from recsys_cli.options import wants_help

    if wants_help(args):
        print(report_help())
        return
    options = parser().parse_args(args)
    console = Console()
    if not console.is_terminal:  # a file or a pipe: no reason to fold the tables to 80 columns
        console = Console(width=200)
    build_report(Path(options.dir).expanduser(), Path(options.out).expanduser() if options.out else None,
                 console=console, plots=not options.no_plots)
