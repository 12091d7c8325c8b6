"""BENCHMARKS.md: one section per benchmark, one table each; runs append rows.

Old rows are never removed, so a changed number sits under the one it
replaces. Every row says the same things about how it was made, in the same
columns: the date (UTC), the machine (lscpu's model, cores, AVX-512 flags,
torch; the GPU where one is used), the load average over the run and the
command that made it. The benchmark harness (bench/harness.py) writes its
rows here; scripts outside it call `record` the same way.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
INTRO = """# Benchmarks

Made by `make bench` (or the command in each row). Ratios are measured within
one run, on the same data, because these machines are noisy. Rows are
appended, never replaced: the newest row of a table is the current number.
"""

Cell = str | int | float | None


@dataclass(frozen=True)
class Load:
    """The 1-minute load average when a run began and when it ended: a
    shared machine's figures mean little without it."""

    start: float
    end: float

    @staticmethod
    def now() -> float:
        return os.getloadavg()[0]

    def __str__(self) -> str:
        return f"{self.start:.1f} -> {self.end:.1f}"


def cpu_model() -> tuple[str, list[str]]:
    """lscpu's model name and the AVX-512 extensions the CPU flags list
    (/proc/cpuinfo where lscpu is missing)."""
    model, flags = "", ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    if not out:
        try:
            out = Path("/proc/cpuinfo").read_text()
        except OSError:
            out = ""
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "model name") and not model:
            model = value.strip()
        elif key.strip() in ("Flags", "flags") and not flags:
            flags = value
    avx512 = sorted(f.removeprefix("avx512").lstrip("_") for f in flags.split() if f.startswith("avx512"))
    return model or "unknown CPU", avx512


def machine() -> str:
    """e.g. '2-core AMD EPYC, AVX-512 (bf16 bw cd ...), torch 2.13.0+cpu'."""
    import torch  # late: a parent that only launches benchmark processes stays small

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    model, avx512 = cpu_model()
    vector = f"AVX-512 ({' '.join(avx512)})" if avx512 else "no AVX-512"
    return f"{os.cpu_count()}-core {model}, {vector}, torch {torch.__version__}"


def today() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def record(section: str, columns: Sequence[str], rows: Sequence[Mapping[str, Cell]], command: str,
           note: str = "", *, load: Load | None = None, doc: Path = DOC, machine_name: str | None = None) -> None:
    """Append `rows` to the table of `section` in `doc` (the section created,
    with `note`, the first time). `load` defaults to the load average now."""
    load = load or Load(Load.now(), Load.now())
    header = ["date", *columns, "machine", "load", "command"]
    where = machine_name or machine()
    lines = ["| " + " | ".join([today(), *(fmt(r.get(c)) for c in columns), where, str(load), f"`{command}`"]) + " |"
             for r in rows]
    text = doc.read_text() if doc.exists() else INTRO
    title = f"## {section}"
    header_line = "| " + " | ".join(header) + " |"
    rule = "|" + "---|" * len(header)
    if f"\n{title}\n" not in f"\n{text}":
        block = [title, ""]
        if note:
            block += [note, ""]
        block += [header_line, rule, *lines, ""]
        text = text.rstrip("\n") + "\n\n" + "\n".join(block)
    else:
        start = f"\n{text}".index(f"\n{title}\n")
        end = text.find("\n## ", start + len(title))
        end = len(text) if end == -1 else end
        section_text = text[start:end].rstrip("\n")
        last_header = [ln for ln in section_text.splitlines() if ln.startswith("| date |")][-1:]
        if last_header != [header_line]:  # the columns changed: a new table under the old one
            text = text[:start] + section_text + "\n" + "\n".join(["", header_line, rule, *lines]) + "\n" + text[end:]
        else:  # under the table's last row, above any note written after the table
            body = section_text.splitlines()
            last_row = max(i for i, ln in enumerate(body) if ln.startswith("|"))
            body[last_row + 1:last_row + 1] = lines
            text = text[:start] + "\n".join(body) + "\n" + text[end:]
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)


def fmt(v: Cell) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != 0 and abs(v) < 0.01:
            return f"{v:.2g}"
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v).replace("|", "/")
