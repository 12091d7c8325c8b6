"""`make bench`: the standard set, or the benchmarks named.

    python -m bench [NAME ...] [--size standard|smoke|...] [--record] [--doc FILE] [--list]

NAME is a benchmark of the standard set (--list) or `module:ATTRIBUTE` naming
a `Benchmark` anywhere importable. --record appends the rows to BENCHMARKS.md
(--doc FILE: to FILE instead); a smoke size never writes BENCHMARKS.md.
Exit 2 with one line on a name or size that does not exist; a benchmark that
fails is reported and the next one runs (exit 1 at the end, no rows for it).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from bench import harness
from bench.record import DOC
from bench.standard import STANDARD, load


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("names", nargs="*", help="benchmarks (default: the standard set)")
    p.add_argument("--size", default="standard", help="a size every named benchmark declares (default: standard)")
    p.add_argument("--record", action="store_true", help="append the rows to BENCHMARKS.md")
    p.add_argument("--doc", type=Path, help="append the rows to this file instead of BENCHMARKS.md")
    p.add_argument("--list", action="store_true", help="the standard set, its sizes and time shares")
    p.add_argument("--child", metavar="SYSTEM", help=argparse.SUPPRESS)  # one isolated system's process
    args = p.parse_args(argv)
    names = args.names or list(STANDARD)
    try:
        benches = [load(n) for n in names]
        for b in benches:
            if args.size not in b.sizes:
                raise LookupError(f"benchmark {b.name} has no size {args.size!r} (sizes: {', '.join(b.sizes)})")
        if args.child:
            if args.child not in {s.name for s in benches[0].systems}:
                raise LookupError(f"benchmark {benches[0].name} has no system {args.child!r}")
            harness.child_main(benches[0], args.size, args.child)
            return 0
    except LookupError as e:
        print(f"bench: {e.args[0]}", file=sys.stderr)
        return 2
    if args.list:
        for b in benches:
            print(f"{b.name:12} {b.seconds:5.0f} s  sizes: {', '.join(b.sizes)}  systems: "
                  f"{', '.join(s.name for s in b.systems)}{'  (each in its own process)' if b.isolated else ''}")
        print(f"{'total':12} {sum(b.seconds for b in benches):5.0f} s of measuring (set-up on top)")
        return 0
    doc: Path | None = args.doc or (DOC if args.record else None)
    if doc == DOC and args.size == "smoke":
        print("bench: smoke sizes are not recorded in BENCHMARKS.md (use --doc FILE)", file=sys.stderr)
        doc = None
    start, failed = time.perf_counter(), []
    for name, b in zip(names, benches):
        try:
            harness.run(b, args.size, name, doc)
        except Exception:  # the next benchmark still runs; this one's rows are not written
            traceback.print_exc()
            failed.append(name)
    print(f"== all: {time.perf_counter() - start:.0f} s")
    if failed:
        print(f"bench: failed: {', '.join(failed)} (no rows written for them)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
