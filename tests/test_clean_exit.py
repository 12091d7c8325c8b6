"""A library call that raised leaves nothing running behind it (issue 40 problem 6).

A script calling recsys_cli.export.raw_inputs on 5,000 raw lines with a
non-hex value on line 3 got the right ValueError, caught it, and then died at
exit with SIGABRT ("terminate called without an active exception") in 2-3
runs of 6. The cause (seen in a core dump): arrow's threaded CSV reader
drops its last reference to its input on one of its worker threads after
read_csv has returned; the input was a pa.py_buffer over a Python bytes
object, whose release takes the GIL, and a thread taking the GIL while the
interpreter finalizes is unwound inside a noexcept destructor. It did not
need the error: a good parse aborted as often. The parser now hands arrow a
copy in arrow's own memory, freed without the GIL.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from data_tools import criteo_text

SCRIPT = textwrap.dedent("""
    import random
    from recsys_cli.export import raw_inputs

    rng = random.Random(0)
    lines = ["\\t".join(["1"] + [str(rng.randint(0, 100)) for _ in range(13)]
                        + ["%08x" % rng.getrandbits(32) for _ in range(26)]) for _ in range(5000)]
    fields = lines[2].split("\\t")
    fields[14 + 4] = "zzzzzzzz"
    lines[2] = "\\t".join(fields)
    try:
        raw_inputs(lines)
    except ValueError as e:
        print(e)
    else:
        raise SystemExit("no ValueError")
""")


def test_the_csv_reader_gets_memory_arrow_owns(monkeypatch):
    """What the reader's worker threads release must not be a Python object:
    the buffer handed to read_csv is arrow's, not a view of the caller's bytes."""
    handed = []
    read_csv = pacsv.read_csv

    def spy(buf, *args, **kwargs):
        handed.append(buf)
        return read_csv(buf, *args, **kwargs)

    monkeypatch.setattr(pacsv, "read_csv", spy)
    data = ("\t".join(["1"] + ["2"] * 13 + ["0000abcd"] * 26) + "\n").encode() * 3
    decoded = criteo_text.BlockParser(labels=True).parse(data, want_dense=True)
    assert decoded.rows == 3 and len(handed) == 1
    assert handed[0].to_pybytes() == data
    assert handed[0].address != pa.py_buffer(data).address  # a copy, not the bytes object's memory


@pytest.mark.verify  # 24 fresh interpreters, each importing torch: 1-2 minutes
def test_a_raising_raw_inputs_exits_cleanly_every_time():
    """Four at a time: the abort was a race with arrow's worker threads, which
    a busy machine (a thread descheduled at the wrong moment) makes likelier.
    A race, so this run of the issue's script is a guard, not a proof: on the
    old parser it aborted 1 run in 8 one hour and none in 24 the next (the
    same machine under other load); test_the_csv_reader_gets_memory_arrow_owns
    checks the cause itself."""
    for batch in range(6):
        runs = [subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for _ in range(4)]
        for run in runs:
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, f"batch {batch}: exit {run.returncode}: {err[-2000:]}"
            assert out.strip() == "line 3: column C5: 'zzzzzzzz' is not 8 hex digits"
