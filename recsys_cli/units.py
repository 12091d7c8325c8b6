"""Sizes for people: the one byte formatter of the tables the tool prints
(the run's summary, `recsys report`, the table placements).

No torch import, so `recsys report` stays light.
"""

from __future__ import annotations


def format_bytes(n: float | None) -> str:
    """646 MiB, 12.5 KiB, 100 B; "-" for None. Binary units, one decimal
    below 100 of a unit, none from 100 up."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:,.1f} {unit}" if abs(n) < 100 else f"{n:,.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: TiB ends the loop")


def count_of(n: int, noun: str) -> str:
    """A count and its noun, plural unless the count is 1: "1 table", "26 tables"."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
