"""The one byte formatter every table of the tool uses (summary, report, table placements)."""

import pytest

from recsys_cli.units import format_bytes


@pytest.mark.parametrize("n, text", [
    (None, "-"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (12.5 * 1024, "12.5 KiB"),
    (99.94 * 2**20, "99.9 MiB"), (646 * 2**20, "646 MiB"), (1536 * 2**30, "1.5 TiB"), (2**50, "1,024 TiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_every_table_uses_the_same_formatter():
    from recsys_cli.embeddings import placement_search
    from recsys_cli.report import tables
    from recsys_cli.train import progress

    assert placement_search.format_bytes is tables.format_bytes is progress.format_bytes is format_bytes
