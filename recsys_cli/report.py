"""`recsys report DIR [--out DIR]`: a table, a CSV file and plots of a run or a sweep.

DIR is one run directory (summary.json, metrics.jsonl, .hydra/overrides.yaml)
or a Hydra multirun directory; every summary.json below DIR is one run. The
report has one row per run: the run's overrides, validation AUC and log loss,
samples/s, embedding bytes on the device and in host memory, cache hit rate,
dedup ratio and seconds per phase. It prints that as tables, writes it to
report.csv and draws:

  throughput.png      samples/s per run, coloured by placement / precision
  auc.png             validation AUC per run, same colours
  phase_seconds.png   seconds per phase per run, stacked
  cache_overhead.png  the cache's cost per step against lookahead window and
                      cache size (only when some run uses a cache)

Everything is written to a temporary name and renamed. A summary.json that
cannot be read is reported as skipped, not fatal. matplotlib is imported only
here, and only when plotting.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from recsys_cli.errors import UserError

# The trainer's phases (recsys_cli.train.trainer.PHASES), in step order; kept
# here so the report does not import torch. Unknown phases follow these.
PHASE_ORDER = ("data_wait", "embedding_forward", "mlp_forward", "backward", "sparse_update", "dense_update", "eval")
PHASE_SHORT = {"data_wait": "wait", "embedding_forward": "emb fwd", "mlp_forward": "mlp fwd", "backward": "bwd",
               "sparse_update": "sparse upd", "dense_update": "dense upd", "eval": "eval"}
CSV_NAME = "report.csv"
PLOT_NAMES = {
    "throughput": "throughput.png",
    "auc": "auc.png",
    "phases": "phase_seconds.png",
    "cache": "cache_overhead.png",
}


# --- reading runs ------------------------------------------------------------------------
@dataclass
class Run:
    dir: Path
    rel: str  # the run directory relative to the report's DIR ("." for DIR itself)
    summary: dict
    overrides: list[str] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl records
    label: str = ""
    notes: list[str] = field(default_factory=list)

    # -- the numbers the report shows --------------------------------------------------
    @property
    def placement(self) -> str:
        return str(self.summary.get("placement") or _cfg(self.summary, "placement", "kind") or "?")

    @property
    def precision(self) -> str:
        return str(self.summary.get("precision") or _cfg(self.summary, "precision", "kind") or "?")

    @property
    def group(self) -> str:
        return f"{self.placement} / {self.precision}"

    @property
    def steps(self) -> int | None:
        return _num(self.summary.get("steps"))

    def final(self, split: str, metric: str) -> float | None:
        value = ((self.summary.get("final") or {}).get(split) or {}).get(metric)
        if value is None:  # an older or interrupted run: the last evaluation logged
            for record in reversed(self.metrics):
                if record.get("split") == split and metric in record:
                    value = record[metric]
                    break
        return _num(value)

    @property
    def train_loss(self) -> float | None:
        for record in reversed(self.metrics):
            if "split" not in record and "loss" in record:
                return _num(record["loss"])
        return None

    @property
    def phase_seconds(self) -> dict[str, float]:
        phases = self.summary.get("phase_seconds") or {}
        return {k: float(v) for k, v in phases.items() if _num(v) is not None}

    @property
    def cache(self) -> dict:
        return self.summary.get("cache") or {}

    @property
    def uses_cache(self) -> bool:
        return "hits" in self.cache or "cache_slots" in self.cache

    @property
    def window(self) -> int | None:
        """The lookahead window, or None for an on-demand cache."""
        if self.placement != "lookahead":
            return None
        return _num(_cfg(self.summary, "placement", "window"))

    @property
    def dedup_ratio(self) -> float | None:
        """Share of a batch's ids that repeat one already in the batch (RecD)."""
        dup = self.summary.get("duplication")
        if isinstance(dup, dict) and _num(dup.get("duplicated_ids")) is not None:
            return dup["duplicated_ids"]
        return _num(self.summary.get("dedup_ratio"))  # summaries before "duplication"

    @property
    def lookups_saved_by_dedup(self) -> float | None:
        dup = self.summary.get("duplication")
        return _num(dup.get("lookups_saved_by_dedup")) if isinstance(dup, dict) else None

    def cache_overhead_ms(self) -> float | None:
        """Trainer-visible cache cost: data_wait + embedding_forward, ms per step."""
        steps, phases = self.steps, self.phase_seconds
        if not steps or not phases:
            return None
        return 1000 * (phases.get("data_wait", 0.0) + phases.get("embedding_forward", 0.0)) / steps

    def cache_fill_ms(self) -> float | None:
        """Time the cache spent filling (prepare), ms per step; for lookahead
        it runs on the prefetch thread, overlapped with training."""
        steps, seconds = self.steps, _num(self.cache.get("prepare_seconds"))
        if not steps or seconds is None:
            return None
        return 1000 * seconds / steps


def _num(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _cfg(summary: dict, *keys):
    node = summary.get("config") or {}
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _natural_key(rel: str):
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"[/\\]", rel)]


def load_run(summary_path: Path, root: Path) -> Run:
    """Read one run directory; ValueError says why its summary.json is unusable
    (the message does not repeat the path)."""
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not readable as JSON ({e})") from None
    if not isinstance(summary, dict):
        raise ValueError(f"expected a JSON object, found {type(summary).__name__}")
    run_dir = summary_path.parent
    rel = run_dir.relative_to(root).as_posix() if run_dir != root else "."
    run = Run(dir=run_dir, rel=rel, summary=summary)
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if overrides.exists():
        import yaml

        try:
            loaded = yaml.safe_load(overrides.read_text())
            if loaded is None:
                loaded = []
            if not isinstance(loaded, list):
                raise ValueError("not a list")
            run.overrides = [str(o) for o in loaded]
        except (OSError, ValueError, yaml.YAMLError) as e:
            run.notes.append(f"{overrides}: unreadable overrides ({str(e).splitlines()[0]}); labelled by directory")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        try:
            for line in metrics.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed run
                if isinstance(record, dict):
                    run.metrics.append(record)
        except (OSError, UnicodeDecodeError):
            run.notes.append(f"{metrics}: unreadable")
    return run


def find_runs(root: Path) -> tuple[list[Run], list[tuple[Path, str]]]:
    """Every run below `root` (natural order: 2 before 10) and the summary.json
    files that were skipped, with why. UserError if root is missing or holds
    no summary.json at all."""
    root = Path(root)
    if not root.exists():
        raise UserError(f"recsys report: {root} does not exist")
    if not root.is_dir():
        raise UserError(f"recsys report: {root} is not a directory (give a run or multirun directory)")
    paths = sorted(root.rglob("summary.json"), key=lambda p: _natural_key(p.parent.relative_to(root).as_posix()))
    if not paths:
        raise UserError(
            f"recsys report: no summary.json in {root} or below it; give a run directory "
            "(outputs/DATE/TIME) or a sweep directory (multirun/DATE/TIME) of finished runs"
        )
    runs, skipped = [], []
    for path in paths:
        try:
            runs.append(load_run(path, root))
        except ValueError as e:
            skipped.append((path, str(e)))
    return runs, skipped


# --- labels ------------------------------------------------------------------------------
def _split_override(text: str) -> tuple[str, str]:
    key, _, value = text.partition("=")
    return key.lstrip("+~"), value


def run_labels(overrides: list[list[str]], fallbacks: list[str]) -> list[str]:
    """Short, unique labels: the overrides that differ between runs, keys cut
    to their last part (optimizer.lr=0.1 -> lr=0.1) where that is unambiguous."""
    parsed = [dict(_split_override(o) for o in run) for run in overrides]
    keys: list[str] = []
    for run in parsed:
        keys.extend(k for k in run if k not in keys)
    varying = [k for k in keys if len(parsed) == 1 or len({run.get(k) for run in parsed}) > 1]
    last = {k: k.rsplit(".", 1)[-1] for k in varying}
    short = {k: last[k] if list(last.values()).count(last[k]) == 1 else k for k in varying}
    labels = []
    for run, fallback in zip(parsed, fallbacks):
        parts = [f"{short[k]}={run[k]}" for k in varying if k in run]
        labels.append(" ".join(parts) or fallback)
    seen: dict[str, int] = {}
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
    return [f"{label} [{fb}]" if seen[label] > 1 else label for label, fb in zip(labels, fallbacks)]


# --- rows ------------------------------------------------------------------------------------
def phases_of(runs: list[Run]) -> list[str]:
    names = {p for run in runs for p in run.phase_seconds}
    return [p for p in PHASE_ORDER if p in names] + sorted(names - set(PHASE_ORDER))


def report_rows(runs: list[Run]) -> list[dict]:
    """One dict per run, in CSV column order."""
    phases = phases_of(runs)
    rows = []
    for run in runs:
        memory = run.summary.get("embedding_bytes") or {}
        row = {
            "run": run.label,
            "dir": run.rel,
            "overrides": " ".join(run.overrides),
            "placement": run.placement,
            "precision": run.precision,
            "steps": run.steps,
            "val_auc": run.final("val", "auc"),
            "val_logloss": run.final("val", "logloss"),
            "train_loss": run.train_loss,
            "samples_per_second": _num(run.summary.get("samples_per_second")),
            "device_bytes": _num(memory.get("device")),
            "host_bytes": _num(memory.get("host")),
            "cache_hit_rate": _num(run.cache.get("hit_rate")),
            "dedup_ratio": run.dedup_ratio,
            "dedup_lookups_saved": run.lookups_saved_by_dedup,
            "cache_fill_ms_per_step": run.cache_fill_ms(),
            # the disk tier (placement disk): empty for runs without one
            "disk_bytes": _num(memory.get("disk")),
            "disk_bytes_read_per_step": _num(run.cache.get("disk_bytes_read_per_step")),
            "disk_bytes_written_per_step": _num(run.cache.get("disk_bytes_written_per_step")),
            "disk_read_amplification": _num(run.cache.get("disk_read_amplification")),
            "host_cache_hit_rate": _num(run.cache.get("host_cache_hit_rate")),
            "disk_wait_seconds_per_step": _num(run.cache.get("disk_wait_seconds_per_step")),
        }
        for phase in phases:
            row[f"seconds_{phase}"] = run.phase_seconds.get(phase)
        rows.append(row)
    return rows


def _atomic_write(path: Path, data: bytes) -> None:
    """Write beside `path` under a temporary name, then rename over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_csv(path: Path, rows: list[dict]) -> None:
    """report.csv, written to a temporary file and renamed; empty cells for missing values."""
    buffer = io.StringIO()
    columns = list(rows[0]) if rows else ["run"]
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    _atomic_write(path, buffer.getvalue().encode())


# --- console tables ------------------------------------------------------------------------
def _fmt(value, spec: str = ",.0f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return format(value, spec)


def _packed_tables(title: str, headers: list[str], cells: list[list[str]], width: int | None,
                   caption: str | None = None) -> list:
    """Tables of `cells` (first column: the run), split by columns into as many
    tables as it takes to fit `width` characters without folding words."""
    from rich.table import Table

    cap = 32 if width is None else max(24, width // 3)  # longer labels fold onto more lines
    label_width = min(max([len(c[0]) for c in cells] + [len(headers[0])]), cap)
    need = [max([len(c[i]) for c in cells] + [len(headers[i])]) for i in range(len(headers))]
    chunks: list[list[int]] = [[]]
    used = label_width + 4
    for i in range(1, len(headers)):
        if width is not None and chunks[-1] and used + need[i] + 3 > width:
            chunks.append([])
            used = label_width + 4
        chunks[-1].append(i)
        used += need[i] + 3
    tables = []
    for n, chunk in enumerate(chunks):
        part = f" ({n + 1}/{len(chunks)})" if len(chunks) > 1 else ""
        table = Table(title=title + part, header_style="bold")
        table.add_column(headers[0], width=label_width, overflow="fold")
        for i in chunk:
            table.add_column(headers[i], justify="left" if i == 1 and headers[i] == "placement" else "right",
                             width=need[i], no_wrap=True)
        for row in cells:
            table.add_row(row[0], *(row[i] for i in chunk))
        tables.append(table)
    if caption:
        tables[-1].caption = caption
    return tables


def format_bytes(n: float | None) -> str:
    """646 MiB, 12.5 KiB, 100 B (the planner's format; kept here so the report does not import torch)."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else (f"{n:,.1f} {unit}" if abs(n) < 100 else f"{n:,.0f} {unit}")
        n /= 1024
    return f"{n:,.1f} TiB" if abs(n) < 100 else f"{n:,.0f} TiB"


def console_tables(rows: list[dict], root: Path, width: int | None = None) -> list:
    """The rich tables `recsys report` prints: metrics per run, seconds per phase;
    each split by columns to fit `width` (no limit when None)."""
    cells = [
        [r["run"], f"{r['placement']}/{r['precision']}", _fmt(r["val_auc"], ".4f"), _fmt(r["val_logloss"], ".4f"),
         _fmt(r["samples_per_second"]), format_bytes(r["device_bytes"]), format_bytes(r["host_bytes"]),
         _fmt(r["cache_hit_rate"], ".3f"), _fmt(r["dedup_ratio"], ".3f")]
        for r in rows
    ]
    headers = ["run", "placement", "val AUC", "val logloss", "samples/s", "device", "host", "hit rate", "dedup"]
    title = f"recsys report: {root} ({len(rows)} run{'s' if len(rows) != 1 else ''})"
    caption = ("device / host: embedding bytes per tier; hit rate: cache hits per unique row looked up; "
               "dedup: share of a batch's ids that repeat one already in the batch")
    tables = _packed_tables(title, headers, cells, width, caption)
    phases = [k[len("seconds_"):] for k in (rows[0] if rows else {}) if k.startswith("seconds_")]
    cells = []
    for r in rows:
        values = [r[f"seconds_{p}"] for p in phases]
        total = sum(v for v in values if v is not None)
        cells.append([r["run"], _fmt(r["steps"]), *(_fmt(v, ".2f") for v in values), f"{total:.2f}"])
    headers = ["run", "steps", *(PHASE_SHORT.get(p, p.replace("_", " ")) for p in phases), "total"]
    tables += _packed_tables("seconds per phase (whole run)", headers, cells, width)
    return tables


# --- plots ---------------------------------------------------------------------------------------
def _save(fig, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    _atomic_write(path, buffer.getvalue())


def _colours(groups: list[str]) -> dict[str, tuple]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    order = list(dict.fromkeys(groups))
    return {g: cmap(i % 10) for i, g in enumerate(order)}


def _run_ticks(ax, xs: list[int], labels: list[str], notes: list[str] | None = None) -> None:
    """Run labels under the bars: one override a line while few runs, slanted
    when many; `notes` go after each label, in parentheses."""
    notes = notes or [""] * len(labels)
    if len(labels) <= 6:
        ax.set_xticks(xs, [label.replace(" ", "\n") + (f"\n({n})" if n else "") for label, n in zip(labels, notes)],
                      fontsize=8)
    else:
        ax.set_xticks(xs, [label + (f" ({n})" if n else "") for label, n in zip(labels, notes)],
                      rotation=30, ha="right", fontsize=8)


def _bar_by_run(runs: list[Run], values: list[float | None], title: str, ylabel: str, fmt: str, zoom: bool):
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    colours = _colours([r.group for r in runs])
    fig = Figure(figsize=(max(6.0, 0.9 * len(runs) + 3), 4.8))
    ax = fig.add_subplot()
    xs = range(len(runs))
    heights = [v if v is not None and not math.isnan(v) else 0.0 for v in values]
    bars = ax.bar(xs, heights, color=[colours[r.group] for r in runs], edgecolor="black", linewidth=0.5)
    present = [v for v in values if v is not None and not math.isnan(v)]
    if zoom and present:
        lo, hi = min(present), max(present)
        pad = max((hi - lo) * 0.3, 0.005)
        ax.set_ylim(max(0.0, lo - pad), hi + pad)
        ylabel += " (axis zoomed, does not start at 0)"
    for bar, v in zip(bars, values):
        text = "n/a" if v is None or math.isnan(v) else format(v, fmt)
        y = bar.get_height() if v is not None and not math.isnan(v) else ax.get_ylim()[0]
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    _run_ticks(ax, list(xs), [r.label for r in runs])
    ax.set_xlabel("run (the overrides that differ between runs)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="black", label=g) for g, c in colours.items()],
              title="placement / precision", fontsize=8, title_fontsize=8, loc="best")
    ax.grid(axis="y", alpha=0.3)
    return fig


def _phase_figure(runs: list[Run]):
    from matplotlib.figure import Figure

    phases = phases_of(runs)
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    fig = Figure(figsize=(max(6.0, 0.9 * len(runs) + 4), 5.0))
    ax = fig.add_subplot()
    xs = list(range(len(runs)))
    bottom = [0.0] * len(runs)
    for i, phase in enumerate(phases):
        heights = [r.phase_seconds.get(phase, 0.0) for r in runs]
        ax.bar(xs, heights, bottom=bottom, label=phase.replace("_", " "), color=cmap(i % 10), edgecolor="white", linewidth=0.5)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, total in zip(xs, bottom):
        ax.annotate(f"{total:.1f} s", (x, total), ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    _run_ticks(ax, xs, [r.label for r in runs], [f"{r.steps:,} steps" if r.steps is not None else "" for r in runs])
    ax.set_xlabel("run (the overrides that differ between runs)")
    ax.set_ylabel("seconds spent in each phase (whole run)")
    ax.set_title("Where the time goes: seconds per training phase, per run")
    ax.legend(title="phase (bottom to top)", fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig


def _cache_size(runs: list[Run]) -> tuple[list, str]:
    """Cache size per run, in one unit for all: slots, else configured rows, else ratio."""
    slots = [_num(r.cache.get("cache_slots")) for r in runs]
    if all(s is not None for s in slots):
        return slots, "cache size (slots, i.e. fp32 rows on the device)"
    rows = [_num(_cfg(r.summary, "placement", "cache_rows")) for r in runs]
    if all(s is not None for s in rows):
        return rows, "cache size (placement.cache_rows)"
    ratio = [_num(_cfg(r.summary, "placement", "cache_ratio")) for r in runs]
    return ratio, "cache size (placement.cache_ratio, fraction of rows)"


def _cache_figure(runs: list[Run]):
    """(d): ms per step the cache costs, against window and cache size."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    sizes, size_label = _cache_size(runs)
    size_of = {id(r): s for r, s in zip(runs, sizes)}
    lookahead = [r for r in runs if r.window is not None]
    window_varies = len({r.window for r in lookahead}) > 1
    size_varies = len({s for s in sizes if s is not None}) > 1
    panels = (["window"] if window_varies else []) + (["size"] if size_varies else [])

    def size_text(value) -> str:
        return f"{value:,} slots" if isinstance(value, int) else f"size {value}"

    def hit_text(run: Run) -> str:
        rate = _num(run.cache.get("hit_rate"))
        return "" if rate is None else f"hit {rate:.0%}"

    if not panels:
        fig = Figure(figsize=(max(6.5, 1.4 * len(runs) + 3), 5.2))
        ax = fig.add_subplot()
        colours = _colours([r.group for r in runs])
        xs = list(range(len(runs)))
        width = 0.38
        waits = [r.cache_overhead_ms() or 0.0 for r in runs]
        fills = [r.cache_fill_ms() or 0.0 for r in runs]
        ax.bar([x - width / 2 for x in xs], waits, width, color=[colours[r.group] for r in runs],
               edgecolor="black", linewidth=0.5)
        ax.bar([x + width / 2 for x in xs], fills, width, color=[colours[r.group] for r in runs],
               edgecolor="black", linewidth=0.5, hatch="//", alpha=0.6)
        for x, r, w in zip(xs, runs, waits):
            ax.annotate(hit_text(r), (x - width / 2, w), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
        ax.set_ylim(0, max(waits + fills + [1e-3]) * 1.2)
        ax.set_xlim(-0.8, len(runs) - 0.2)
        _run_ticks(ax, xs, [r.label for r in runs])
        ax.set_xlabel("run with a cache")
        ax.set_ylabel("ms per training step")
        windows = sorted({r.window for r in lookahead})
        same = [f"window {windows[0]}"] if len(windows) == 1 else []
        present = sorted({v for v in sizes if v is not None})
        if len(present) == 1:
            same.append(size_text(present[0]))
        note = f" ({', '.join(same)} in every run)" if same else ""
        ax.set_title(f"Cache overhead per training step{note}", fontsize=10)
        handles = [
            Patch(facecolor="lightgrey", edgecolor="black", label="plain bar: data wait + embedding lookup\n(the trainer waits)"),
            Patch(facecolor="lightgrey", edgecolor="black", hatch="//", label="hatched bar: cache fill\n(lookahead: on the prefetch thread)"),
        ] + [Patch(facecolor=c, edgecolor="black", label=f"colour: {g}") for g, c in colours.items()]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  title="placement / precision", title_fontsize=7)
        ax.grid(axis="y", alpha=0.3)
        return fig

    fig = Figure(figsize=(6.5 * len(panels), 5.0))

    def lines(ax, members: list[Run], x_of, series_of, xlabel: str):
        series: dict[str, list[Run]] = {}
        for r in members:
            series.setdefault(series_of(r), []).append(r)
        cmap = _colours(list(series))
        for k, (name, rs) in enumerate(series.items()):
            rs = sorted((r for r in rs if x_of(r) is not None), key=x_of)
            xs = [x_of(r) for r in rs]
            waits = [r.cache_overhead_ms() for r in rs]
            ax.plot(xs, waits, marker="o", color=cmap[name], label=f"{name}: data wait + lookup")
            fill = [r.cache_fill_ms() for r in rs]
            if any(v is not None for v in fill):
                ax.plot(xs, fill, marker="s", linestyle="--", color=cmap[name], alpha=0.7, label=f"{name}: cache fill")
            for r, x, y in zip(rs, xs, waits):
                if y is not None and hit_text(r):
                    ax.annotate(hit_text(r), (x, y), fontsize=7, color=cmap[name],
                                xytext=(4, 4 + 9 * k), textcoords="offset points")
        ticks = sorted({x_of(r) for r in members if x_of(r) is not None})
        ax.set_xticks(ticks)
        if all(isinstance(t, int) for t in ticks):
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per training step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")

    for i, panel in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        if panel == "window":
            lines(ax, lookahead, lambda r: r.window, lambda r: f"{r.precision}, {size_text(size_of[id(r)])}",
                  "lookahead window (batches prefetched ahead, placement.window)")
            ax.set_title("Cache overhead against the lookahead window")
        else:
            lines(ax, runs, lambda r: size_of[id(r)],
                  lambda r: f"{r.placement}/{r.precision}" + (f", window {r.window}" if r.window is not None else ""),
                  size_label)
            present = [v for v in sizes if v]
            if present and max(present) / min(present) >= 10:
                ax.set_xscale("log")
            ax.set_title("Cache overhead against cache size")
    fig.suptitle("What the embedding cache costs per training step "
                 "(solid: time the trainer waits for data and lookups; dashed: time spent filling the cache)",
                 fontsize=10)
    return fig


def make_plots(runs: list[Run], out: Path) -> tuple[list[Path], list[str]]:
    """Write the PNGs; returns (files written, notes). Needs matplotlib."""
    written, notes = [], []
    fig = _bar_by_run(runs, [_num(r.summary.get("samples_per_second")) for r in runs],
                      "Training throughput per run (higher is better)", "training samples per second", ",.0f", zoom=False)
    _save(fig, out / PLOT_NAMES["throughput"])
    written.append(out / PLOT_NAMES["throughput"])
    aucs = [r.final("val", "auc") for r in runs]
    fig = _bar_by_run(runs, aucs, "Validation AUC per run (higher is better)", "validation AUC", ".4f", zoom=True)
    _save(fig, out / PLOT_NAMES["auc"])
    written.append(out / PLOT_NAMES["auc"])
    if any(r.phase_seconds for r in runs):
        _save(_phase_figure(runs), out / PLOT_NAMES["phases"])
        written.append(out / PLOT_NAMES["phases"])
    else:
        notes.append("no run reports seconds per phase: skipped the phase plot")
    cached = [r for r in runs if r.uses_cache]
    cache_png = out / PLOT_NAMES["cache"]
    if cached:
        _save(_cache_figure(cached), cache_png)
        written.append(cache_png)
    else:
        notes.append("no run uses a cache (placement lookahead/cache or a low-precision table): "
                     f"skipped the cache-overhead plot ({PLOT_NAMES['cache']})")
        if cache_png.exists():  # from an earlier report of other runs: it would mislead
            cache_png.unlink()
    return written, notes


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
    try:
        write_csv(csv_path, rows)
        written: list[Path] = []
        if plots:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                notes.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
            else:
                written, plot_notes = make_plots(runs, out)
                notes.extend(plot_notes)
    except PermissionError as e:
        raise UserError(f"recsys report: cannot write into {out}: {e.strerror}") from None
    report = Report(root, out, runs, skipped, rows, csv_path, written, notes)
    if console is not None:
        for path, why in skipped:
            console.print(f"[yellow]skipped[/] {path}: {why}", highlight=False)
        for note in notes:
            console.print(f"[yellow]note:[/] {note}", highlight=False)
        console.print(f"wrote {csv_path}" + "".join(f"\nwrote {p}" for p in written), highlight=False)
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


def run_report(args: list[str]) -> None:
    """`recsys report DIR [--out DIR] [--no-plots]`."""
    from rich.console import Console

    options = parser().parse_args(args)
    console = Console()
    if not console.is_terminal:  # a file or a pipe: no reason to fold the tables to 80 columns
        console = Console(width=200)
    build_report(Path(options.dir).expanduser(), Path(options.out).expanduser() if options.out else None,
                 console=console, plots=not options.no_plots)
