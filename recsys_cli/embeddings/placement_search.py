"""The automatic placement search: `placement=auto placement.device_memory_budget=64MiB`.

Pure functions; placement.py and the trainer wire them in. What it
decides from: how often each row is read in a sample (access_profile.py:
measure_access, measure_skew) and what each placement costs in bytes
(placement_bytes.py, which parse_bytes reads a budget for).

  place_tables     per table, `device` (the whole fp32 table on the device) or
                   `lookahead` (the table in host memory, in the run's
                   precision, behind an fp32 device cache of `cache_rows`
                   slots), never using more device bytes than the budget;
                   with a host budget, `disk` for the largest, coldest
                   lookahead tables until the host bytes fit it.

On CUDA the budget holds the allocator's bytes, not the tensors'
(placement_bytes.py), so the placement fills the budget less that rounding
for every device tensor the build allocates, and a placement the allocator
counts over the budget is never made.

How place_tables decides (Acun et al.: placement decides throughput):
  1. Everything fits on the device: everything goes there.
  2. Every table needs at least a cache that holds one batch's unique rows
     (the cache's hard limit, see CacheTooSmall). If those minimum caches do
     not fit, the budget is too small and the error names both numbers.
  3. The rest of the budget goes greedily to the rows that serve the most
     reads per byte. A table's reads are modelled from its hot set (the
     fewest rows that serve target_hit_rate of its reads, from
     measure_skew): its hot rows serve target_hit_rate of the reads, the
     rest of the table the remainder, each spread evenly. So per table there
     are two pieces to buy, in order: the cache from the minimum up to the
     hot set (dense in reads), then the rest of the table (sparse). Small
     and hot tables have the most reads per byte in both pieces, so they go
     whole onto the device first; large tables get caches that grow toward
     their hot set; the cold rest of a large table comes last.
  4. A cache that holds its whole table becomes a device table (the same
     device bytes, no host copy, no cache traffic).
  5. With a host budget (placement.host_memory_budget), host tables move to
     disk (disk_store.py: the rows in a file, a host cache of
     host_cache_ratio of them, the same device cache) while the host bytes
     exceed it, coldest per byte first (fewest sampled reads per host byte,
     then the largest): a cold large table saves the most host memory for
     the least disk traffic. If every host table on disk still does not fit,
     the budget is too small and the error names the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recsys_cli.embeddings.placement_bytes import (BUDGET_KEY, PRECISIONS, allocated_device_bytes, allocator_reserve,
                                                   device_allocations, device_row_bytes, format_count, table_footprint)
from recsys_cli.embeddings.table_init import TableSpec
from recsys_cli.errors import UserError
from recsys_cli.units import count_of, format_bytes


# --- the result -----------------------------------------------------------------------
@dataclass
class TablePlacements:
    """Where every table goes."""

    placements: dict[str, str]  # table -> "device" | "lookahead" | "disk"
    cache_rows: dict[str, int]  # lookahead and disk tables -> cache slots
    expected_bytes: dict[str, int]  # {"device": ..., "host": ...}
    reasons: dict[str, str]  # table -> one sentence
    budget_bytes: int = 0
    precision: str = "fp32"  # of the host tables; device tables are fp32
    table_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # table -> {"device", "host"}
    num_rows: dict[str, int] = field(default_factory=dict)
    host_budget_bytes: int | None = None
    disk_bytes: int = 0  # bytes of the disk tables' files
    budget_key: str = BUDGET_KEY  # the key budget_bytes came from (on a CPU, maybe placement.host_memory_budget)

    @property
    def total_cache_rows(self) -> int:
        """Slots of the caches of every lookahead and disk table."""
        return sum(self.cache_rows.values())

    @property
    def lookahead_tables(self) -> list[str]:
        return [t for t, p in self.placements.items() if p == "lookahead"]

    @property
    def disk_tables(self) -> list[str]:
        return [t for t, p in self.placements.items() if p == "disk"]

    def cache_rows_of(self, kind: str) -> int:
        """Slots of the fused cache of the tables placed `kind` (lookahead or disk)."""
        return sum(n for t, n in self.cache_rows.items() if self.placements[t] == kind)

    @property
    def device_tables(self) -> list[str]:
        return [t for t, p in self.placements.items() if p == "device"]

    def build_arguments(self) -> dict:
        """build_embeddings arguments that realise the placements: device tables in
        fp32, the others in the search's precision behind one lookahead cache
        (host tables) and one more for the disk tables."""
        precisions = {t: ("fp32" if p == "device" else self.precision) for t, p in self.placements.items()}
        cache_rows = {kind: self.cache_rows_of(kind) or None for kind in ("lookahead", "disk")}
        return {"placements": self.placements, "precisions": precisions, "cache_rows": cache_rows}

    def table(self):
        """A rich Table: one row per table, totals in the caption. Each
        table's reason is not a column (at 80 columns it wrapped to a few
        characters a line): why_lines() gives them, one line each, to print below."""
        from rich.table import Table
        from rich.text import Text

        table = Table(
            title=f"table placement: {format_bytes(self.expected_bytes['device'])} of "
                  f"{format_bytes(self.budget_bytes)} device budget"
                  + ("" if self.budget_key == BUDGET_KEY else f" ({self.budget_key}: on a CPU the device is host memory)"),
            header_style="bold",
        )
        for name, justify in (("table", "left"), ("rows", "right"), ("placement", "left"), ("precision", "left"),
                              ("cache rows", "right"), ("device", "right"), ("host", "right")):
            table.add_column(name, justify=justify, no_wrap=True)
        for name, placement in self.placements.items():
            b = self.table_bytes.get(name, {})
            table.add_row(
                Text(name), f"{self.num_rows.get(name, 0):,}", placement,
                "fp32" if placement == "device" else self.precision,
                f"{self.cache_rows[name]:,}" if name in self.cache_rows else "-",
                format_bytes(b.get("device")), format_bytes(b.get("host")),
            )
        table.caption = (
            f"device {format_bytes(self.expected_bytes['device'])}, host {format_bytes(self.expected_bytes['host'])}"
        )
        if self.lookahead_tables:  # none when every table is on the device: no cache to describe
            table.caption += (f"; {count_of(len(self.lookahead_tables), 'table')} behind one lookahead cache of "
                              f"{self.cache_rows_of('lookahead'):,} rows")
        if self.disk_tables:
            table.caption += (f"; {count_of(len(self.disk_tables), 'table')} on disk "
                              f"({format_bytes(self.disk_bytes)}) behind "
                              f"one of {self.cache_rows_of('disk'):,} rows, within the "
                              f"{format_bytes(self.host_budget_bytes)} host budget")
        return table

    def why_lines(self) -> list[str]:
        """Why each table went where it did, one line per table (each reason names its table)."""
        return [f"  why {self.reasons[name]}" for name in self.placements if self.reasons.get(name)]


def place_tables(
    tables: list[TableSpec],
    hot_rows: dict[str, int],
    budget_bytes: int,
    precision: str = "fp32",
    optimizer_state_per_row: int = 0,
    batch_unique_rows: dict[str, int] | None = None,
    target_hit_rate: float = 0.9,
    reads: dict[str, int] | None = None,
    policy: str = "lru",
    host_budget_bytes: int | None = None,
    host_cache_ratio: float = 0.05,
    budget_key: str = BUDGET_KEY,
) -> TablePlacements:
    """Choose `device` or `lookahead` (with a cache size) for every table so the
    embeddings use at most `budget_bytes` of device memory; see the module
    docstring for the rules.

    hot_rows: per table, the rows that serve target_hit_rate of its reads
    (measure_skew); a table missing from it counts as never read.
    optimizer_state_per_row: fp32 values of state per row (0 for SGD, 1 for
    row-wise Adagrad). batch_unique_rows: per table, the most unique rows one
    batch reads (the least cache it can train with; 1 when not given).
    reads: per table, how many reads the sample had (AccessProfile.reads);
    when not given every table counts as read equally often (one-hot
    features, as in Criteo). policy: the cache's victim policy
    (placement.policy); the bytes do not depend on it (LFU admission, and its
    per-row use counts, belong to the on-demand cache only).
    budget_key: the config key budget_bytes came from, for the messages.
    Raises UserError when even the minimum caches do not fit."""
    if precision not in PRECISIONS:
        raise UserError(f"precision.kind={precision!r} is not one of {', '.join(PRECISIONS)}")
    if budget_bytes < 0:
        raise UserError(f"{budget_key} is negative ({budget_bytes} bytes)")
    if not 0 < target_hit_rate <= 1:
        raise UserError(f"target hit rate must be in (0, 1], got {target_hit_rate}")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate table names in {names}")
    state = optimizer_state_per_row
    batch_unique_rows = batch_unique_rows or {}
    spec = {t.name: t for t in tables}
    row_b = {t.name: device_row_bytes(t.dim, state) for t in tables}
    full = {t.name: t.num_rows * row_b[t.name] for t in tables}
    hot = {t.name: max(0, int(hot_rows.get(t.name, 0))) for t in tables}
    minimum = {t.name: min(t.num_rows, max(int(batch_unique_rows.get(t.name, 0)), 1)) for t in tables}
    target = {t.name: min(t.num_rows, max(hot[t.name], minimum[t.name])) for t in tables}
    pct = f"{target_hit_rate * 100:g} %"

    def describe(t: TableSpec) -> str:
        return f"{format_count(t.num_rows)} rows x {row_b[t.name]} B = {format_bytes(full[t.name])}"

    # The allocator's rounding: 511 bytes at most per tensor to start with; a placement
    # whose blocks (a tensor over 1 MiB may keep 1 MiB more) still exceed the
    # budget is made again with that much more reserved (never more than the
    # bound for large tensors, with which every placement fits), until it fits.
    # Counted on a CPU too: one budget then places the tables alike on both.
    reserve, most = allocator_reserve(state), allocator_reserve(state, large=True)
    for attempt in range(8):
        placements: dict[str, str] = {}
        cache: dict[str, int] = {}
        reasons: dict[str, str] = {}
        total_full = sum(full.values())
        all_on_device = allocated_device_bytes(device_allocations(tables, dict.fromkeys(names, "device"), {}, state))
        if all_on_device <= budget_bytes:
            for t in tables:
                placements[t.name] = "device"
                reasons[t.name] = (f"{t.name}: {describe(t)} on the device; all tables "
                                   f"({format_bytes(total_full)}) fit the {format_bytes(budget_bytes)} budget")
        else:
            min_needed = sum(minimum[n] * row_b[n] for n in names)
            if min_needed + reserve > budget_bytes:
                worst = max(tables, key=lambda t: minimum[t.name] * row_b[t.name])
                raise UserError(
                    f"{budget_key}={format_bytes(budget_bytes)} ({budget_bytes:,} bytes) is too small: the tables "
                    f"need {format_bytes(total_full)} and even caches that hold one batch's unique rows of every "
                    f"table need {format_bytes(min_needed + reserve)} ({min_needed + reserve:,} bytes, of which "
                    f"{reserve:,} for the CUDA allocator's rounding, counted on a CPU too so that both place "
                    f"alike; the largest, {worst.name}, "
                    f"{minimum[worst.name]:,} rows x {row_b[worst.name]} B); raise the budget or lower "
                    "trainer.batch_size"
                )
            cache = dict(minimum)
            left = budget_bytes - reserve - min_needed
            # The pieces to buy: (reads served per byte, tie-breaks, table, rows).
            pieces = []
            for i, n in enumerate(names):
                t = spec[n]
                weight = 1.0 if reads is None else float(reads.get(n, 0))
                if hot[n] == 0:
                    weight = 0.0  # never read in the sample
                dense = weight * target_hit_rate / (max(hot[n], 1) * row_b[n])
                rest = t.num_rows - target[n]
                sparse = weight * (1 - target_hit_rate) / (max(rest, 1) * row_b[n])
                if target[n] > minimum[n]:
                    pieces.append((-dense, full[n], i, 0, n, target[n] - minimum[n]))
                if rest > 0:  # never before the table's own dense piece
                    pieces.append((-min(sparse, dense), full[n], i, 1, n, rest))
            for *_, n, rows in sorted(pieces):
                take = min(rows, left // row_b[n])
                cache[n] += take
                left -= take * row_b[n]
            for t in tables:
                n = t.name
                if cache[n] >= t.num_rows:
                    placements[n] = "device"
                    del cache[n]
                    if minimum[n] >= t.num_rows:
                        why = "one batch reads every row"
                    elif target[n] >= t.num_rows:
                        why = f"its hot set ({pct} of accesses) is the whole table"
                    else:
                        why = ("small enough that keeping it whole serves more reads per byte than growing "
                               "the caches of larger tables")
                    reasons[n] = f"{n}: {describe(t)} on the device: {why}"
                    continue
                placements[n] = "lookahead"
                head = f"{n}: {describe(t)} does not fit; cache of {cache[n]:,} rows"
                if hot[n] == 0:
                    reasons[n] = f"{head} (no reads of it were measured in the sample)"
                elif cache[n] == minimum[n] and minimum[n] >= hot[n]:
                    reasons[n] = (f"{head} holds one batch's unique rows "
                                  f"(at least the {hot[n]:,} rows that serve {pct} of accesses)")
                elif cache[n] > hot[n]:
                    reasons[n] = f"{head} covers more than {pct} of accesses ({hot[n]:,} rows cover {pct})"
                elif cache[n] == hot[n]:
                    reasons[n] = f"{head} covers {pct} of accesses"
                else:
                    batch = f"; one batch needs {minimum[n]:,}" if minimum[n] > 1 else ""
                    reasons[n] = (f"{head}, limited by the budget ({hot[n]:,} rows would cover {pct} of "
                                  f"accesses{batch})")
        if host_budget_bytes is not None:
            _spill_to_disk(tables, placements, cache, reasons, reads, precision, state, policy, host_budget_bytes,
                           host_cache_ratio)
        allocated = allocated_device_bytes(device_allocations(tables, placements, cache, state))
        if allocated <= budget_bytes:
            break
        reserve = min(most, reserve + allocated - budget_bytes) if attempt < 6 else most
    else:  # a bug, never the user's doing
        raise AssertionError(f"placement may take {allocated} device bytes (allocator blocks) of a {budget_bytes} budget")
    table_bytes = {t.name: table_footprint(t, placements[t.name], cache.get(t.name, 0), precision, state, policy,
                                        host_cache_ratio)
                   for t in tables}
    expected = {
        "device": sum(b["device"] for b in table_bytes.values()),
        "host": sum(b["host"] for b in table_bytes.values()),
    }
    return TablePlacements(
        placements=placements, cache_rows=cache, expected_bytes=expected, reasons=reasons,
        budget_bytes=budget_bytes, precision=precision, table_bytes=table_bytes,
        num_rows={t.name: t.num_rows for t in tables}, host_budget_bytes=host_budget_bytes,
        disk_bytes=sum(b.get("disk", 0) for b in table_bytes.values()), budget_key=budget_key,
    )


def _spill_to_disk(tables, placements, cache, reasons, reads, precision, state, policy, budget, ratio) -> None:
    """Rule 5: move lookahead tables to disk, coldest per host byte first,
    until the host bytes fit `budget`; UserError when even all of them on disk do not."""
    host = lambda t, p: table_footprint(t, p, cache.get(t.name, 0), precision, state, policy, ratio)["host"]  # noqa: E731
    total = sum(host(t, placements[t.name]) for t in tables)
    if total <= budget:
        return
    def coldness(t):  # fewest reads per host byte, then the largest
        r = 1.0 if reads is None else float(reads.get(t.name, 0))
        return (r / max(host(t, "lookahead"), 1), -host(t, "lookahead"), t.name)
    candidates = sorted((t for t in tables if placements[t.name] == "lookahead"), key=coldness)
    for t in candidates:
        if total <= budget:
            break
        saved = host(t, "lookahead") - host(t, "disk")
        if saved <= 0:
            continue
        placements[t.name] = "disk"
        total -= saved
        reasons[t.name] = (f"{reasons[t.name]}; on disk: the host tables need more than the "
                           f"{format_bytes(budget)} host budget and this is among the coldest per byte")
    if total > budget:
        raise UserError(
            f"placement.host_memory_budget={format_bytes(budget)} ({budget:,} bytes) is too small: with every "
            f"host table on disk the host still needs {format_bytes(total)} ({total:,} bytes: host caches of "
            f"placement.host_cache_ratio={ratio:g} and cache indexes); raise the budget or lower host_cache_ratio"
        )
