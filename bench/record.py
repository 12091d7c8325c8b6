"""BENCHMARKS.md: one section per benchmark, one table each; runs append rows.

Old rows are never removed, so a changed number sits under the one it
replaces, each with its date, machine and the command that made it.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
INTRO = """# Benchmarks

Made by `make bench` (or the command in each row). Ratios are measured within
one run, on the same data, because these machines are noisy. Rows are
appended, never replaced: the newest row of a table is the current number.
"""


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()}-core {cpu} CPU, torch {torch.__version__}"


def record(section: str, columns: list[str], rows: list[dict], command: str, note: str = "") -> None:
    """Append `rows` to the table of `section` (created with `note` the first time)."""
    header = ["date", *columns, "machine", "command"]
    today = dt.date.today().isoformat()
    lines = [
        "| " + " | ".join([today, *(_fmt(r.get(c)) for c in columns), machine(), f"`{command}`"]) + " |"
        for r in rows
    ]
    text = DOC.read_text() if DOC.exists() else INTRO
    title = f"## {section}"
    if title not in text:
        block = [title, ""]
        if note:
            block += [note, ""]
        block += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *lines, ""]
        text = text.rstrip("\n") + "\n\n" + "\n".join(block)
    else:
        start = text.index(title)
        end = text.find("\n## ", start + len(title))
        end = len(text) if end == -1 else end
        section_text = text[start:end].rstrip("\n")
        header_line = "| " + " | ".join(header) + " |"
        last_header = [ln for ln in section_text.splitlines() if ln.startswith("| date |")][-1:]
        if last_header != [header_line]:  # the columns changed: a new table under the old one
            lines = ["", header_line, "|" + "---|" * len(header), *lines]
            text = text[:start] + section_text + "\n" + "\n".join(lines) + "\n" + text[end:]
        else:  # under the table's last row, above any note written after the table
            body = section_text.splitlines()
            last_row = max(i for i, ln in enumerate(body) if ln.startswith("|"))
            body[last_row + 1:last_row + 1] = lines
            text = text[:start] + "\n".join(body) + "\n" + text[end:]
    tmp = DOC.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, DOC)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and abs(v) < 0.01:
            return f"{v:.2g}"
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)
