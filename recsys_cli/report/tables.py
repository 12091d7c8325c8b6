"""The report's tables: the rich tables `recsys report` prints and report.csv."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from recsys_cli.report.runs import atomic_write
from recsys_cli.units import format_bytes

PHASE_SHORT = {"data_wait": "wait", "embedding_forward": "emb fwd", "mlp_forward": "mlp fwd", "backward": "bwd",
               "sparse_update": "sparse upd", "dense_update": "dense upd", "eval": "eval"}
CSV_NAME = "report.csv"


def _csv_cell(value):
    if value is None:
        return ""
    if isinstance(value, list):  # one value per rank (sharding_rank_*): space-separated in one cell
        return " ".join("" if v is None else str(v) for v in value)
    return value


def write_csv(path: Path, rows: list[dict]) -> None:
    """report.csv, written to a temporary file and renamed; empty cells for
    missing values, a list's values space-separated in its cell."""
    buffer = io.StringIO()
    columns = list(rows[0]) if rows else ["run"]
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_cell(v) for k, v in row.items()})
    atomic_write(path, buffer.getvalue().encode())


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
    from rich.text import Text

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
        table = Table(title=Text(title + part), header_style="bold")  # a run's path and label: never markup
        table.add_column(headers[0], width=label_width, overflow="fold")
        for i in chunk:
            table.add_column(headers[i], justify="left" if i == 1 and headers[i] == "placement" else "right",
                             width=need[i], no_wrap=True)
        for row in cells:
            table.add_row(Text(row[0]), *(Text(row[i]) for i in chunk))
        tables.append(table)
    if caption:
        tables[-1].caption = caption
    return tables


def console_tables(rows: list[dict], root: Path, width: int | None = None) -> list:
    """The rich tables `recsys report` prints: metrics per run, seconds per phase
    and, when a run has tables on disk, the disk tier's figures, when a run
    shards its tables, bytes and lookups per rank; each split by columns to
    fit `width` (no limit when None)."""
    cells = [
        [r["run"], f"{r['placement']}/{r['precision']}", _fmt(r["val_auc"], ".4f"), _fmt(r["val_logloss"], ".4f"),
         _fmt(r["samples_per_second"]), format_bytes(r["device_bytes"]), format_bytes(r["host_bytes"]),
         _fmt(r["cache_hit_rate"], ".3f"), _fmt(r["dedup_ratio"], ".3f")]
        for r in rows
    ]
    headers = ["run", "placement", "val AUC", "val logloss", "steady samples/s", "device", "host", "hit rate", "dedup"]
    title = f"recsys report: {root} ({len(rows)} run{'s' if len(rows) != 1 else ''})"
    caption = ("steady samples/s: training samples per second after the warm-up steps, evaluation and "
               "checkpoints left out (- for runs from before it was measured; report.csv has their "
               "wall_samples_per_second); device / host: embedding bytes per tier; hit rate: cache hits per "
               "unique row looked up; dedup: share of a batch's ids that repeat one already in the batch")
    tables = _packed_tables(title, headers, cells, width, caption)
    phases = [k[len("seconds_"):] for k in (rows[0] if rows else {}) if k.startswith("seconds_")]
    cells = []
    for r in rows:
        values = [r[f"seconds_{p}"] for p in phases]
        total = sum(v for v in values if v is not None)
        cells.append([r["run"], _fmt(r["steps"]), *(_fmt(v, ".2f") for v in values), f"{total:.2f}"])
    headers = ["run", "steps", *(PHASE_SHORT.get(p, p.replace("_", " ")) for p in phases), "total"]
    tables += _packed_tables("seconds per phase (whole run)", headers, cells, width)
    disk = [r for r in rows if r.get("disk_bytes")]
    if disk:  # only when some run keeps tables on disk (placement=disk)
        wait_ms = lambda s: None if s is None else s * 1000  # noqa: E731
        cells = [[r["run"], format_bytes(r["disk_bytes"]), format_bytes(r["disk_bytes_read_per_step"]),
                  format_bytes(r["disk_bytes_written_per_step"]), _fmt(r["disk_read_amplification"], ".2f"),
                  _fmt(r["host_cache_hit_rate"], ".3f"), _fmt(wait_ms(r["disk_wait_seconds_per_step"]), ".1f")]
                 for r in disk]
        headers = ["run", "on disk", "read/step", "written/step", "read amp", "host hit rate", "wait ms/step"]
        caption = ("read amp: bytes read from disk per row byte needed; host hit rate: the disk store's host "
                   "cache hits per row it served; wait: the trainer's time on the disk store per step")
        tables += _packed_tables("disk tier", headers, cells, width, caption)
    sharded = [r for r in rows if r.get("sharding_rank_bytes")]
    if sharded:  # only when some run shards its tables (placement.sharding=table|row|auto)
        cells = []
        for r in sharded:
            lookups = r["sharding_rank_lookups"] or [None] * r["sharding_ranks"]
            for rank, (nbytes, lk, shards) in enumerate(zip(r["sharding_rank_bytes"], lookups,
                                                               r["sharding_rank_shards"])):
                first = rank == 0
                cells.append([r["run"] if first else "", (r["sharding"] or "?") if first else "", str(rank),
                              _fmt(shards), format_bytes(nbytes), _fmt(lk),
                              f"{r['sharding_imbalance']:.3f}x" if first and r["sharding_imbalance"] else ""])
        headers = ["run", "kind", "rank", "shards", "bytes", "lookups", "max/mean"]  # narrow: one table at 80 columns
        caption = ("kind: placement.sharding; shards: the tables, or row ranges of tables, a rank holds; bytes: "
                   "its tables' bytes, optimizer state included; lookups: the ids it is expected to serve per "
                   "step (global batch); max/mean: the largest rank's bytes over the mean (1.000x: even)")
        tables += _packed_tables("sharded tables, per rank", headers, cells, width, caption)
    return tables

