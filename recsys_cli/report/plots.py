"""The report's plots (matplotlib, imported only when plotting):

  throughput.png      steady-state samples/s per run, coloured by placement / precision
  auc.png             validation AUC per run, same colours, one panel per dataset
  phase_seconds.png   seconds per phase per run, stacked
  cache_overhead.png  the cache's cost per step against lookahead window and
                      cache size (only when some run uses a cache)
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from recsys_cli.report.runs import Run, atomic_write, config_value, number, phases_of

PLOT_NAMES = {
    "throughput": "throughput.png",
    "auc": "auc.png",
    "phases": "phase_seconds.png",
    "cache": "cache_overhead.png",
}


def _save(fig, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    atomic_write(path, buffer.getvalue())


def _colours(groups: list[str]) -> dict[str, tuple]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    order = list(dict.fromkeys(groups))
    return {g: cmap(i % 10) for i, g in enumerate(order)}


# Inches a character of the 8-point tick labels takes, and a line of them.
_CHAR_INCHES = 0.07
_LINE_INCHES = 0.16
_STACKED_MAX = 8  # up to this many runs, one override a line under each bar; more: vertical labels


def _tick_texts(labels: list[str], notes: list[str] | None = None) -> list[str]:
    notes = notes or [""] * len(labels)
    if len(labels) <= _STACKED_MAX:
        return [label.replace(" ", "\n") + (f"\n({n})" if n else "") for label, n in zip(labels, notes)]
    return [label + (f" ({n})" if n else "") for label, n in zip(labels, notes)]


def _run_inches(labels: list[str], notes: list[str] | None = None) -> float:
    """Width a run needs along the x axis so that its label does not run into
    its neighbours': the longest line of a stacked label, or a line's height
    when the labels stand vertically."""
    if len(labels) > _STACKED_MAX:
        return max(0.5, 2 * _LINE_INCHES)
    longest = max((len(line) for t in _tick_texts(labels, notes) for line in t.split("\n")), default=0)
    return max(0.9, _CHAR_INCHES * longest + 0.25)


def _run_ticks(ax, xs: list[int], labels: list[str], notes: list[str] | None = None) -> None:
    """Run labels under the bars: one override a line while few runs (the
    figure is made wide enough for the longest, _run_inches), vertical when many."""
    texts = _tick_texts(labels, notes)
    if len(labels) <= _STACKED_MAX:
        ax.set_xticks(xs, texts, fontsize=8)
    else:
        ax.set_xticks(xs, texts, rotation=90, ha="center", fontsize=8)


def _headroom(ax, top: float) -> None:
    """Room above the tallest bar for its value label (else clipped at the frame)."""
    if top > 0:
        ax.set_ylim(ax.get_ylim()[0], top * 1.12)


def _draw_bars(ax, runs: list[Run], values: list[float | None], colours: dict, ylabel: str, fmt: str,
               zoom: bool) -> None:
    xs = range(len(runs))
    heights = [v if v is not None and not math.isnan(v) else 0.0 for v in values]
    bars = ax.bar(xs, heights, color=[colours[r.group] for r in runs], edgecolor="black", linewidth=0.5)
    present = [v for v in values if v is not None and not math.isnan(v)]
    if zoom and present:
        lo, hi = min(present), max(present)
        pad = max((hi - lo) * 0.3, 0.005)
        ax.set_ylim(max(0.0, lo - pad), hi + pad)
        ylabel += " (axis zoomed, does not start at 0)"
    else:
        _headroom(ax, max(heights, default=0.0))
    for bar, v in zip(bars, values):
        text = "n/a" if v is None or math.isnan(v) else format(v, fmt)
        y = bar.get_height() if v is not None and not math.isnan(v) else ax.get_ylim()[0]
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    _run_ticks(ax, list(xs), [r.label for r in runs])
    ax.set_xlabel("run (the overrides that differ between runs)")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def _legend(ax, colours: dict) -> None:
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(facecolor=c, edgecolor="black", label=g) for g, c in colours.items()],
              title="placement / precision", fontsize=8, title_fontsize=8, loc="best")


def _bar_by_run(runs: list[Run], values: list[float | None], title: str, ylabel: str, fmt: str, zoom: bool):
    from matplotlib.figure import Figure

    colours = _colours([r.group for r in runs])
    fig = Figure(figsize=(max(6.0, _run_inches([r.label for r in runs]) * len(runs) + 3), 4.8))
    ax = fig.add_subplot()
    _draw_bars(ax, runs, values, colours, ylabel, fmt, zoom)
    ax.set_title(title)
    _legend(ax, colours)
    return fig


def by_dataset(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs grouped by the dataset they trained on, in first-seen order."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.dataset, []).append(r)
    return groups


def _auc_figure(runs: list[Run]):
    """Validation AUC per run; one panel (and axis) per dataset: AUCs of
    different data are not comparable, and one zoomed axis would squash both."""
    from matplotlib.figure import Figure

    groups = by_dataset(runs)
    colours = _colours([r.group for r in runs])
    widths = [max(3.0, _run_inches([r.label for r in g]) * len(g) + 1.5) for g in groups.values()]
    fig = Figure(figsize=(max(6.0, sum(widths) + 1.5), 4.8), layout="constrained")  # panels apart from each other
    axes = fig.subplots(1, len(groups), squeeze=False, gridspec_kw={"width_ratios": widths})[0]
    for ax, (dataset, members) in zip(axes, groups.items()):
        _draw_bars(ax, members, [r.final("val", "auc") for r in members], colours, "validation AUC", ".4f", zoom=True)
        ax.set_title(f"dataset: {dataset}" if len(groups) > 1 else "Validation AUC per run (higher is better)",
                     fontsize=10)
    if len(groups) > 1:
        fig.suptitle("Validation AUC per run, one panel per dataset (higher is better)")
    _legend(axes[-1], colours)
    return fig


def _phase_figure(runs: list[Run]):
    from matplotlib.figure import Figure

    phases = phases_of(runs)
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    notes = [f"{r.steps:,} steps" if r.steps is not None else "" for r in runs]
    fig = Figure(figsize=(max(6.0, _run_inches([r.label for r in runs], notes) * len(runs) + 4), 5.0))
    ax = fig.add_subplot()
    xs = list(range(len(runs)))
    bottom = [0.0] * len(runs)
    for i, phase in enumerate(phases):
        heights = [r.phase_seconds.get(phase, 0.0) for r in runs]
        ax.bar(xs, heights, bottom=bottom, label=phase.replace("_", " "), color=cmap(i % 10), edgecolor="white", linewidth=0.5)
        bottom = [b + h for b, h in zip(bottom, heights)]
    _headroom(ax, max(bottom, default=0.0))
    for x, total in zip(xs, bottom):
        ax.annotate(f"{total:.1f} s", (x, total), ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    _run_ticks(ax, xs, [r.label for r in runs], notes)
    ax.set_xlabel("run (the overrides that differ between runs)")
    ax.set_ylabel("seconds spent in each phase (whole run)")
    ax.set_title("Where the time goes: seconds per training phase, per run")
    ax.legend(title="phase (bottom to top)", fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig


def _cache_size(runs: list[Run]) -> tuple[list, str]:
    """Cache size per run, in one unit for all: slots, else configured rows, else ratio."""
    slots = [number(r.cache.get("cache_slots")) for r in runs]
    if all(s is not None for s in slots):
        return slots, "cache size (slots, i.e. fp32 rows on the device)"
    rows = [number(config_value(r.summary, "placement", "cache_rows")) for r in runs]
    if all(s is not None for s in rows):
        return rows, "cache size (placement.cache_rows)"
    ratio = [number(config_value(r.summary, "placement", "cache_ratio")) for r in runs]
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
        rate = number(run.cache.get("hit_rate"))
        return "" if rate is None else f"hit {rate:.0%}"

    if not panels:
        fig = Figure(figsize=(max(6.5, max(1.4, _run_inches([r.label for r in runs])) * len(runs) + 3), 5.2))
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
        windows = sorted({r.window for r in lookahead if r.window is not None})
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
    fig = _bar_by_run(runs, [r.steady_samples_per_second for r in runs],
                      "Training throughput per run, steady state (higher is better)",
                      "training samples per second, steady state\n(after warm-up; evaluation and checkpoints left out)",
                      ",.0f", zoom=False)
    _save(fig, out / PLOT_NAMES["throughput"])
    written.append(out / PLOT_NAMES["throughput"])
    _save(_auc_figure(runs), out / PLOT_NAMES["auc"])
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

