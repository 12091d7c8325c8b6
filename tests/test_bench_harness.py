"""The benchmark harness (bench/harness.py) end to end on the tiny example
benchmarks (bench/example.py), through `python -m bench` as `make bench`
runs it: the rows it appends to a temporary BENCHMARKS.md, never the real one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import harness, record
from bench.__main__ import main as bench_main
from bench.example import SUM
from bench.standard import STANDARD, load

ROOT = Path(__file__).resolve().parents[1]


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`python -m bench ARGS` in this process (the isolated systems' processes
    are started all the same): its exit code and stderr."""
    code = bench_main(list(args))
    return code, capsys.readouterr().err


def _table(text: str, section: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the section's last table."""
    lines = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0].splitlines()
    start = max(i for i, ln in enumerate(lines) if ln.startswith("| date |"))
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[start:] if ln.startswith("|")]
    return cells[0], cells[2:]


def test_rows_of_both_modes_land_under_the_old_ones_in_one_format(tmp_path, capsys, monkeypatch):
    real = record.DOC.read_bytes()
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## Example: Python sum vs torch.sum\n\nan old note\n\n| date | old |\n|---|---|\n"
                   "| 2020-01-01 | 1 |\n\n## Later section\n\nkept\n")
    monkeypatch.chdir(ROOT)  # where the isolated systems' processes find `bench`
    for address in ("bench.example:SUM", "bench.example:MEMORY"):
        code, err = _main(capsys, address, "--size", "smoke", "--doc", str(doc))
        assert code == 0, err[-2000:]
    text = doc.read_text()
    assert "| 2020-01-01 | 1 |" in text and "## Later section\n\nkept\n\n## Example: peak RSS" in text  # kept
    assert text.index("| 2020-01-01 | 1 |") < text.index("python -m bench bench.example:SUM") < text.index("## Later")
    header, rows = _table(text, "Example: Python sum vs torch.sum")
    assert header[:1] == ["date"] and header[-3:] == ["machine", "load", "command"]  # the new table (columns changed)
    assert [r[header.index("system")] for r in rows] == ["python", "torch"]
    model, avx512 = record.cpu_model()
    for r in rows:
        cell = dict(zip(header, r))
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", cell["date"]) and cell["size"] == "smoke" and cell["rounds"] == "3"
        assert model in cell["machine"] and ("AVX-512" in cell["machine"]) == bool(avx512)
        assert re.fullmatch(r"\d+\.\d -> \d+\.\d", cell["load"])
        assert cell["command"] == "`python -m bench bench.example:SUM --size smoke`"
        assert float(cell["numbers/s"].replace(",", "")) > 0
    assert dict(zip(header, rows[0]))["vs python (median, min-max)"] == "1.000 (1.000-1.000)"  # the baseline
    header, rows = _table(text, "Example: peak RSS of a 1x and a 4x buffer")
    got = {r[header.index("system")]: dict(zip(header, r)) for r in rows}
    # Each system's own process: the 4x buffer's 96 MiB more show in its peak RSS alone.
    extra = float(got["4x"]["peak RSS MiB"].replace(",", "")) - float(got["1x"]["peak RSS MiB"].replace(",", ""))
    assert 80 < extra < 160, got
    assert record.DOC.read_bytes() == real  # the real BENCHMARKS.md untouched


def test_alternation_rotates_the_order_and_stops_when_the_time_share_is_spent():
    order: list[str] = []

    class Logged(harness.SystemRun):
        def __init__(self, name: str) -> None:
            self.name = name

        def chunk(self) -> int:
            order.append(self.name)
            return 1

    size = harness.Size(rounds=5, warmup=1)
    results = harness.alternate({"a": Logged("a"), "b": Logged("b")}, size, seconds=60, report=lambda _: None)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]  # warm-ups, then rotated rounds
    assert [len(r.rates) for r in results] == [5, 5] and results[0].ratios == [1.0] * 5
    order.clear()
    results = harness.alternate({"a": Logged("a"), "b": Logged("b")}, size, seconds=0, report=lambda _: None)
    assert [len(r.rates) for r in results] == [harness.MIN_ROUNDS] * 2  # a spent share still gives a range


def test_unknown_names_and_sizes_are_one_line_and_exit_2(capsys):
    code, err = _main(capsys, "no-such-benchmark", "--size", "smoke")
    assert code == 2 and err.count("\n") == 1 and "no-such-benchmark" in err
    code, err = _main(capsys, "bench.example:SUM", "--size", "huge")
    assert code == 2 and err.count("\n") == 1 and "no size 'huge'" in err
    code, err = _main(capsys, "bench.example:SUM", "--size", "smoke", "--child", "numpy")
    assert code == 2 and "no system 'numpy'" in err


def test_every_standard_benchmark_declares_smoke_and_standard_sizes():
    for name in STANDARD:
        bench = load(name)
        assert bench.name == name and {"smoke", "standard"} <= set(bench.sizes)
    assert sum(load(n).seconds for n in STANDARD) <= 10 * 60  # make bench: <= 15 minutes, set-up included
    with pytest.raises(ValueError, match="no size standard"):
        harness.Benchmark(name="x", section="x", sizes={"smoke": harness.Size()}, systems=SUM.systems)


def test_a_failing_benchmark_writes_no_rows_and_the_next_one_runs(tmp_path, capsys, monkeypatch):
    import bench.__main__ as cli

    class Broken(harness.SystemRun):
        def chunk(self) -> int:
            raise RuntimeError("broken on purpose")

    broken = harness.Benchmark(name="broken", section="Broken", sizes={"smoke": harness.Size(), "standard": harness.Size()},
                               systems=[harness.System("x", lambda size: Broken())])
    real_load = cli.load
    monkeypatch.setattr(cli, "load", lambda name: broken if name == "broken" else real_load(name))
    doc = tmp_path / "BENCHMARKS.md"
    code, err = _main(capsys, "broken", "bench.example:SUM", "--size", "smoke", "--doc", str(doc))
    assert code == 1 and "broken on purpose" in err and "failed: broken (no rows" in err
    text = doc.read_text()
    assert "## Broken" not in text and "`python -m bench bench.example:SUM --size smoke`" in text


def test_a_second_run_appends_under_the_last_row_above_a_note_written_after_the_table(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    load = record.Load(1.0, 2.0)
    record.record("S", ["x"], [{"x": 1}], "cmd one", "the note", load=load, doc=doc, machine_name="m")
    doc.write_text(doc.read_text() + "\nA note under the table.\n\n## T\n")
    record.record("S", ["x"], [{"x": 2.5}], "cmd two", load=load, doc=doc, machine_name="m")
    text = doc.read_text()
    today = record.today()
    assert (f"| date | x | machine | load | command |\n|---|---|---|---|---|\n| {today} | 1 | m | 1.0 -> 2.0 | `cmd one` |\n"
            f"| {today} | 2.500 | m | 1.0 -> 2.0 | `cmd two` |\n\nA note under the table.\n\n## T\n") in text
    assert text.count("the note") == 1
