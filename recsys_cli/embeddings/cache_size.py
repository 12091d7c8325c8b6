"""How many slots a lookahead (or on-demand) fp32 cache gets when the config gives a ratio.

`placement.cache_ratio` of a group's rows is right for large tables, but on
small data 5 % of the rows can be less than one batch needs (10k real Criteo
rows at batch 128: 2,180 slots for up to 2,569 unique rows), and the run would
stop at step 0. A one-hot feature puts at most `batch_size` ids into a batch,
so one batch reads at most min(rows, batch_size) rows of its table, and the
`window` batches a lookahead cache holds at once at most
min(rows, window * batch_size): that sum over the group's one-hot tables is a
bound that holds for every batch, computed before any table is built. A
ratio-sized cache is raised to it (never above the group's rows); an explicit
`placement.cache_rows` is kept as given. Multi-hot features have no such
bound (a bag may hold any number of ids) and are left out of it, which the
start-up line says.
"""

from __future__ import annotations

from dataclasses import dataclass

from recsys_cli.units import count_of


@dataclass(frozen=True)
class CacheSize:
    slots: int
    why: str  # the start-up line's reason


def cache_size(tables: list[tuple[str, int]], cache_rows: int | None, cache_ratio: float, batch_ids: dict | None,
               batches_held: int) -> CacheSize:
    """Slots of a cache over `tables` ((name, rows) each). batch_ids: per table
    the most ids one batch can hold (None for a multi-hot feature); unset, no
    floor (callers that size caches themselves). batches_held: the batches
    the cache holds at once (the lookahead window; 1 for an on-demand cache)."""
    total = sum(rows for _, rows in tables)
    if cache_rows is not None:
        return CacheSize(max(1, min(total, cache_rows)), f"placement.cache_rows={cache_rows}")
    by_ratio = max(1, min(total, int(round(total * cache_ratio))))
    why = f"placement.cache_ratio={cache_ratio:g} of {total:,} rows"
    if batch_ids is None:
        return CacheSize(by_ratio, why)
    bounded = [(rows, batch_ids[name]) for name, rows in tables if batch_ids.get(name) is not None]
    floor = min(total, sum(min(rows, batches_held * ids) for rows, ids in bounded))
    unbounded = len(tables) - len(bounded)
    if floor > by_ratio:
        held = f"the {batches_held} batches of the window" if batches_held > 1 else "one batch"
        per_batch = max(ids for _, ids in bounded)
        why = (f"{why} would be {by_ratio:,}; raised to what {held} can need: {count_of(len(bounded), 'table')} x "
               f"min(rows, {batches_held} x {per_batch:,} ids)")
        slots = floor
    else:
        slots = by_ratio
    if unbounded:
        verbs = "has no per-batch bound and is" if unbounded == 1 else "have no per-batch bound and are"
        why += f" ({count_of(unbounded, 'multi-hot table')} {verbs} not counted)"
    return CacheSize(slots, why)
