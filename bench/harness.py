"""The benchmark harness: a benchmark declares its systems, sizes and what it
measures; the harness runs them and writes the BENCHMARKS.md rows.

A benchmark (bench/standard/*.py, bench/README.md says how to declare one):

* sizes: named `Size`s (at least "smoke", seconds, and "standard", what
  `make bench` runs); each says how many rounds of how many chunks;
* systems: `System`s, each a name and a function that builds a `SystemRun`
  for a size (set-up: data, model; not timed) whose `chunk()` does one
  chunk of work (timed) and returns how many `unit`s it did;
* isolated: False (default) builds every system in one process and runs
  them in rounds, one chunk each, the order rotated round by round, so a
  change in the machine's load hits every system alike; each round gives
  each system's rate and its ratio to the first system (the baseline), and
  the row reports the median rate and the median, min and max ratio.
  True runs each system in its own process (`python -m bench --child`)
  whose peak RSS (VmHWM: that process's own high-water mark) is the row's
  "peak RSS MiB"; for benchmarks that measure memory.

Systems that share data (a generated file, a checkpoint) build it once in
`work_dir()`: one scratch directory per benchmark run, the same in every
system's process, removed when the run ends.

Rounds stop early, after at least two, once the benchmark's `seconds` (its
share of `make bench`'s stated time) are spent; the row says how many ran.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from bench.record import DOC, Cell, Load, fmt, machine, record

MIB = 2**20
MIN_ROUNDS = 2  # a ratio's range needs two rounds
WORK_ENV = "RECSYS_BENCH_WORK"  # the run's scratch directory, inherited by the systems' processes


def work_dir() -> Path:
    """The running benchmark's scratch directory, shared by its systems."""
    if WORK_ENV not in os.environ:
        raise RuntimeError("work_dir() is for systems the harness runs (python -m bench)")
    return Path(os.environ[WORK_ENV])


def say(line: str) -> None:
    print(line, flush=True)  # before a child process's lines


@dataclass(frozen=True)
class Size:
    """How much a benchmark runs: `rounds` rounds of one chunk per system,
    after `warmup` chunks each. A benchmark subclasses it with its own
    fields (rows, steps per chunk, batch size)."""

    rounds: int = 3
    warmup: int = 1


SizeT = TypeVar("SizeT", bound=Size)


class SystemRun(ABC):
    """One system, built for one size. `chunk` is the timed unit of work."""

    @abstractmethod
    def chunk(self) -> int:
        """Do one chunk of work; return how many units (samples, rows) it did."""

    def extras(self) -> Mapping[str, Cell]:
        """Figures beyond the rate, read after the last round (a hit rate, an AUC, bytes)."""
        return {}

    def close(self) -> None:
        """Stop threads, free what the run holds (before the next benchmark)."""


@dataclass(frozen=True)
class System(Generic[SizeT]):
    name: str
    build: Callable[[SizeT], SystemRun]


@dataclass(frozen=True)
class Benchmark(Generic[SizeT]):
    name: str  # `make bench ARGS=NAME`
    section: str  # the BENCHMARKS.md heading its rows go under
    sizes: Mapping[str, SizeT]  # "smoke" and "standard" at least
    systems: Sequence[System[SizeT]]  # the first is the baseline of the ratios
    unit: str = "samples"  # what chunk() counts; rates are unit/s
    isolated: bool = False  # each system in its own process, its peak RSS measured
    seconds: float = 120.0  # its share of `make bench`: no new round once spent
    note: str = ""  # the section's note, written with its first table

    def __post_init__(self) -> None:
        missing = {"smoke", "standard"} - set(self.sizes)
        if missing:
            raise ValueError(f"benchmark {self.name}: no size {', '.join(sorted(missing))}")
        if len({s.name for s in self.systems}) != len(self.systems) or not self.systems:
            raise ValueError(f"benchmark {self.name}: systems need distinct names, at least one")

    def system(self, name: str) -> System[SizeT]:
        for s in self.systems:
            if s.name == name:
                return s
        raise KeyError(name)


@dataclass
class SystemResult:
    """What one system measured: its rate in each round, its ratio to the
    baseline (per round in one process; of the medians when isolated), the
    extras and, isolated, its process's peak RSS."""

    name: str
    rates: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    extras: Mapping[str, Cell] = field(default_factory=dict)
    peak_rss_bytes: int | None = None


def timed_chunk(run: SystemRun) -> float:
    """units/s of one chunk."""
    start = time.perf_counter()
    units = run.chunk()
    seconds = time.perf_counter() - start
    return units / max(seconds, 1e-9)


def alternate(runs: Mapping[str, SystemRun], size: Size, seconds: float,
              report: Callable[[str], None] = say) -> list[SystemResult]:
    """Warm-up chunks, then rounds of one chunk per system, the order rotated."""
    names = list(runs)
    results = {n: SystemResult(n) for n in names}
    for n in names:
        for _ in range(size.warmup):
            timed_chunk(runs[n])
    deadline = time.monotonic() + seconds
    for r in range(size.rounds):
        if r >= MIN_ROUNDS and time.monotonic() > deadline:
            report(f"  time share spent: {r} of {size.rounds} rounds")
            break
        order = names[r % len(names):] + names[:r % len(names)]  # no system always first
        rates = {n: timed_chunk(runs[n]) for n in order}
        for n in names:
            results[n].rates.append(rates[n])
            results[n].ratios.append(rates[n] / rates[names[0]])
        report(f"  round {r + 1}: " + "  ".join(f"{n} {rates[n]:,.0f}/s" for n in names))
    for n in names:
        results[n].extras = dict(runs[n].extras())
    return list(results.values())


def run_in_process(bench: Benchmark[SizeT], size_name: str, systems: Sequence[str] | None = None,
                   report: Callable[[str], None] = say, seconds: float | None = None) -> list[SystemResult]:
    """Build the chosen systems (all by default) here and alternate them."""
    size = bench.sizes[size_name]
    chosen = [bench.system(n) for n in systems] if systems else list(bench.systems)
    runs: dict[str, SystemRun] = {}
    try:
        for s in chosen:
            runs[s.name] = s.build(size)
        return alternate(runs, size, bench.seconds if seconds is None else seconds, report)
    finally:
        for r in runs.values():
            r.close()


def child_main(bench: Benchmark[SizeT], size_name: str, system: str) -> None:
    """The process of one isolated system: its result as the last line of stdout."""
    from recsys_cli.train.memory import peak_rss_bytes  # VmHWM: this process's own peak

    share = bench.seconds / len(bench.systems)
    result = run_in_process(bench, size_name, [system], report=lambda line: print(line, file=sys.stderr),
                            seconds=share)[0]
    print(json.dumps({"name": result.name, "rates": result.rates, "extras": dict(result.extras),
                      "peak_rss_bytes": peak_rss_bytes()}))


def run_isolated(bench: Benchmark[SizeT], size_name: str, address: str,
                 report: Callable[[str], None] = say) -> list[SystemResult]:
    """Each system in its own process (`python -m bench ADDRESS --child
    SYSTEM`), one after another; the ratios are of median rates."""
    results = []
    for s in bench.systems:
        command = [sys.executable, "-m", "bench", address, "--size", size_name, "--child", s.name]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{bench.name}/{s.name}: its process exited {done.returncode}")
        got = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(SystemResult(got["name"], rates=got["rates"], extras=got["extras"],
                                    peak_rss_bytes=got["peak_rss_bytes"]))
        report(f"  {s.name}: {statistics.median(got['rates']):,.0f}/s, peak RSS "
               f"{got['peak_rss_bytes'] / MIB:,.0f} MiB")
    base = statistics.median(results[0].rates)
    for r in results:
        r.ratios = [statistics.median(r.rates) / base]
    return results


def rows(bench: Benchmark[SizeT], size_name: str, results: Sequence[SystemResult]) -> tuple[list[str], list[dict[str, Cell]]]:
    """The table's columns and one row per system."""
    baseline = bench.systems[0].name
    rate = f"{bench.unit}/s"
    ratio = f"vs {baseline}" if bench.isolated else f"vs {baseline} (median, min-max)"
    out: list[dict[str, Cell]] = []
    for r in results:
        row: dict[str, Cell] = {"size": size_name, "system": r.name, "rounds": len(r.rates),
                                rate: statistics.median(r.rates)}
        if bench.isolated:
            row[ratio] = r.ratios[0]
            row["peak RSS MiB"] = None if r.peak_rss_bytes is None else r.peak_rss_bytes / MIB
            base_rss = results[0].peak_rss_bytes
            row[f"RSS vs {baseline}"] = (None if r.peak_rss_bytes is None or not base_rss
                                         else r.peak_rss_bytes / base_rss)
        else:
            row[ratio] = (f"{statistics.median(r.ratios):.3f} ({min(r.ratios):.3f}-{max(r.ratios):.3f})")
        row.update(r.extras)
        out.append(row)
    columns: list[str] = []
    for row in out:
        columns += [c for c in row if c not in columns]
    return columns, out


def run(bench: Benchmark[SizeT], size_name: str, address: str, doc: Path | None = DOC,
        report: Callable[[str], None] = say) -> list[dict[str, Cell]]:
    """Run `bench` at `size_name`; append its rows to `doc` (None: print
    only). `address` is what `python -m bench` loads it by (the row's command)."""
    if size_name not in bench.sizes:
        raise KeyError(f"benchmark {bench.name} has no size {size_name!r} (sizes: {', '.join(bench.sizes)})")
    report(f"== {bench.name} ({size_name}): {', '.join(s.name for s in bench.systems)}")
    start, load_start = time.perf_counter(), Load.now()
    with tempfile.TemporaryDirectory(prefix=f"recsys-bench-{bench.name}-") as work:
        os.environ[WORK_ENV] = work
        try:
            results = (run_isolated(bench, size_name, address, report) if bench.isolated
                       else run_in_process(bench, size_name, report=report))
        finally:
            del os.environ[WORK_ENV]
    load = Load(load_start, Load.now())
    columns, table = rows(bench, size_name, results)
    for row in table:
        report("  " + ", ".join(f"{k} {fmt(v)}" for k, v in row.items()))
    report(f"== {bench.name}: {time.perf_counter() - start:.0f} s, load {load}")
    if doc is not None:
        command = shlex.join(["python", "-m", "bench", address, "--size", size_name])
        record(bench.section, columns, table, command, bench.note, load=load, doc=doc, machine_name=machine())
    return table
