"""The training progress bar and the end-of-run table (rich)."""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.text import Text
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from recsys_cli.units import format_bytes


class TrainProgress:
    def __init__(self, total: int, done: int, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TimeRemainingColumn(),
            console=console, disable=not enabled, transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=done, info=self.info(float("nan"), 0.0))

    @staticmethod
    def info(loss: float, rate: float) -> str:
        return f"loss {loss:.4f} {rate:,.0f} samples/s"

    def __enter__(self) -> "TrainProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, loss: float, rate: float) -> None:
        self.progress.update(self.task, completed=step, info=self.info(loss, rate))

    @contextmanager
    def evaluation(self, split: str, batches: int):
        """A second bar while a split is scored, removed when it is done;
        yields the function to call after each batch."""
        if not self.enabled:
            yield lambda: None
            return
        task = self.progress.add_task(f"eval {split}", total=batches, info="")
        try:
            yield lambda: self.progress.advance(task)
        finally:
            self.progress.remove_task(task)


def dedup_batches(summary: dict) -> str:
    """What a deduplicated run's batches held, and why: sessions are kept by
    default where the dataset has a session column, unless the user turned
    that off."""
    if summary.get("session_shuffle"):
        return "whole sessions"
    if summary.get("session_column"):
        return "shuffled samples (sessions not kept: dedup.keep_sessions=false)"
    if "session_column" in summary:
        return "shuffled samples (no session column)"
    return "shuffled samples"  # a summary.json from before session_column: the reason is not known


def summary_table(summary: dict) -> Table:
    table = Table(title="recsys train: summary", show_header=True, header_style="bold")
    table.add_column("what")
    table.add_column("value", justify="right")

    def add(what: str, value: str) -> None:  # a reason, a path: printed as they are, never read as markup
        table.add_row(Text(what), Text(value))

    add("device / placement / precision / dedup",
        f"{summary['device']} / {summary['placement']} / {summary['precision']} / {'on' if summary['dedup'] else 'off'}")
    if summary["dedup"]:  # in-batch dedup needs no sessions; they only make batches hold more duplicates
        add("dedup batches", dedup_batches(summary))
    add("steps", f"{summary['steps']:,}")
    loop = summary.get("loop") or {}
    if loop.get("stopped"):
        add("stopped early", f"at step {loop['stopped']['step']:,}: {loop['stopped']['reason']}")
    if loop.get("best_checkpoint"):
        add(f"best val {loop['monitor']} (checkpoint)", f"{loop['best']:.4f} at step {loop['best_step']:,} "
                                                        f"({loop['best_checkpoint']})")
    tp = summary["throughput"]
    steady = summary["samples_per_second"]
    add(f"samples/s, steady state (after {tp['warmup_steps']} warm-up steps, without eval and checkpoints)",
        "-" if steady is None else f"{steady:,.0f}")
    add("wall clock: total / in eval / in checkpoints",
        f"{tp['wall_seconds']:.2f} s / {tp['eval_seconds']:.2f} s / {tp['checkpoint_seconds']:.2f} s")
    for split, m in summary["final"].items():
        add(f"{split} AUC / logloss / accuracy", f"{m['auc']:.4f} / {m['logloss']:.4f} / {m['accuracy']:.4f}")
        if "predicted_ctr" in m:  # calibration: a miscalibrated split shows at a glance
            add(f"{split} normalized entropy", f"{m['normalized_entropy']:.4f}")
            add(f"{split} CTR predicted / observed", f"{m['predicted_ctr']:.4f} / {m['observed_ctr']:.4f}")
    train = summary.get("train_calibration") or {}
    if train.get("samples"):
        add("train batches CTR predicted / observed", f"{train['predicted_ctr']:.4f} / {train['observed_ctr']:.4f}")
    for phase, seconds in summary["phase_seconds"].items():
        add(f"seconds: {phase}", f"{seconds:.2f}")
    # Several processes: rank 0 writes the summary; its tables (a shard of them, sharded) and
    # its slices of the global batches, not the sums over the ranks.
    rank0 = " (rank 0)" if summary.get("distributed") else ""
    mem = summary["embedding_bytes"]
    add(f"embedding bytes: device / host{rank0}", f"{format_bytes(mem['device'])} / {format_bytes(mem['host'])}")
    allocated = summary.get("embedding_bytes_allocated")
    if allocated is not None:  # CUDA: what the allocators hold, beside the tensor sizes above
        add("  allocated: device / pinned host", f"{format_bytes(allocated['device'])} / {format_bytes(allocated['pinned_host'])}")
    add("  of which tables / cache / cache index", f"{format_bytes(mem['table'])} / {format_bytes(mem['cache'])} / {format_bytes(mem['index'])}")
    auto = summary.get("auto_placement")
    if auto:
        add("device budget (auto placement)", f"{format_bytes(mem['device'])} used of {format_bytes(auto['budget_bytes'])}")
    add("peak host RSS", format_bytes(summary["peak_host_rss_bytes"]))
    if summary.get("peak_device_bytes") is not None:
        add("peak device memory / pinned host", f"{format_bytes(summary['peak_device_bytes'])} / "
                                                f"{format_bytes(summary.get('peak_pinned_host_bytes'))}")
    cache = summary.get("cache") or {}
    if "hits" in cache:
        add("cache hit rate", f"{cache['hit_rate']:.3f}" if cache.get("hit_rate") is not None else "-")
        add("cache rows loaded / evicted", f"{cache['rows_loaded']:,} / {cache['rows_evicted']:,}")
        add("bytes host->device / device->host", f"{format_bytes(cache['bytes_to_device'])} / {format_bytes(cache['bytes_to_host'])}")
        waited = cache.get("prepare_wait_seconds")  # absent from summaries before 2026-12-07
        add("cache fill / wait seconds",
            f"{cache['prepare_seconds']:.2f} / " + (f"{waited:.2f}" if waited is not None else "-"))
        if "window_used_mean" in cache:
            add("lookahead window used (min / mean)", f"{cache['window_used_min']} / {cache['window_used_mean']:.1f}")
        if "disk_bytes_read" in cache:  # the disk tier
            add("disk tables / host cache rows", f"{format_bytes(mem.get('disk', 0))} / {cache['host_cache_rows']:,}")
            add("disk bytes read / written per step", f"{format_bytes(cache.get('disk_bytes_read_per_step', 0))} / "
                                                      f"{format_bytes(cache.get('disk_bytes_written_per_step', 0))}")
            amp, hit = cache.get("disk_read_amplification"), cache.get("host_cache_hit_rate")
            add("disk read amplification / host cache hit rate",
                f"{'-' if amp is None else f'{amp:.2f}'} / {'-' if hit is None else f'{hit:.3f}'}")
            add("disk I/O seconds / trainer waited on disk",
                f"{cache['disk_io_seconds']:.2f} / {cache['disk_wait_seconds']:.2f}")
    elif "bytes_to_device" in cache:
        add("bytes host->device / device->host", f"{format_bytes(cache['bytes_to_device'])} / {format_bytes(cache['bytes_to_host'])}")
    dup = summary["duplication"]
    add(f"duplicated ids in batches (RecD){rank0}", f"{dup['duplicated_ids']:.3f}")
    if summary["dedup"]:
        add("lookups saved by dedup", f"{dup['lookups_saved_by_dedup']:.3f}")
        worst = sorted(dup["duplicated_ids_per_feature"].items(), key=lambda kv: -kv[1])[:3]
        add("most duplicated features", ", ".join(f"{k} {v:.2f}" for k, v in worst))
    return table
