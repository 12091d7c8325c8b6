"""Criteo Terabyte's split (`split_by=terabyte`): the day a row belongs to is its file.

Criteo 1TB comes as 24 files, day_0 .. day_23 (plain or .gz), one a day in
time order. The dlrm reference's `--data-set=terabyte` (and MLPerf's DLRM
runs) train on days 0-22 and halve day 23: its first ceil(n / 2) rows are
test, the rest validation, n its (valid) rows. A file's day is the last
number in its name (day_7, day_7.gz, criteo_day7.tsv); the files must be days
0 .. K-1, each once. K = 24 is the full data set; 2 <= K < 24 is a sample
(train = days 0 .. K-2, the last day halved), stated in the summary and in
manifest.options.terabyte_days. Anything else is refused before any work.
(MLPerf's DLRM-DCNv2 loader, mlcommons/training recommendation_v2, halves
day 23 the other way round: first half validation, second half test.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from data_tools.errors import UserError

FULL_DAYS = 24
_DAY = re.compile(r"(\d+)(?!.*\d)")  # the last number in a name


def terabyte_days(paths: Sequence[Path]) -> int:
    """The number of days K the files are (days 0 .. K-1, in input order);
    a UserError naming the file otherwise."""
    days = []
    for p in paths:
        m = _DAY.search(p.name)
        if m is None:
            raise UserError(f"split_by=terabyte: {p} has no day number in its name (Criteo 1TB's files are "
                            f"day_0 .. day_{FULL_DAYS - 1}, plain or .gz)")
        days.append(int(m.group(1)))
    expected = list(range(len(paths)))
    if days != expected:
        wrong = next(i for i, (d, e) in enumerate(zip(days, expected)) if d != e)
        raise UserError(f"split_by=terabyte needs the days 0 .. K-1 in order, each once (day_0 .. day_{FULL_DAYS - 1} "
                        f"for Criteo 1TB); file {wrong + 1} of {len(paths)}, {paths[wrong]}, is day {days[wrong]}, "
                        f"expected day {expected[wrong]}")
    if not 2 <= len(days) <= FULL_DAYS:
        raise UserError(f"split_by=terabyte needs 2 .. {FULL_DAYS} day files (train days, then the day halved into test "
                        f"and val), got {len(days)}: {', '.join(map(str, paths))}")
    return len(days)


def terabyte_ranges(file_rows: Sequence[int]) -> list[tuple[str, int, int]]:
    """(split, start, end) global row ranges: train = every day but the
    last; the last day's first ceil(n / 2) rows test, the rest val."""
    train = sum(file_rows[:-1])
    last = file_rows[-1]
    test = (last + 1) // 2
    return [("train", 0, train), ("test", train, train + test), ("val", train + test, train + last)]


def describe(days: int) -> str:
    """The split in words, for the summary."""
    sample = "" if days == FULL_DAYS else f" (a {days}-day sample of Criteo 1TB's {FULL_DAYS})"
    return f"terabyte split{sample}: train days 0-{days - 2}, day {days - 1} halved into test then val"
