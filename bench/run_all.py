"""`make bench`: every benchmark, in sequence, appending its rows to BENCHMARKS.md.

    .venv/bin/python -m bench.run_all [--only NAME ...] [--quick]

Sizes are chosen so the whole suite fits in about 20 minutes on 2 cores;
--quick shrinks every benchmark (for a smoke run, not for the record).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

SUITE = {
    "preprocess": ["bench.preprocess_bench", "--rows", "2000000", "--record"],
    "train": ["bench.train_bench", "--rows", "300000", "--steps", "600", "--record"],
    "placement": ["bench.placement_bench", "--rows", "400000", "--steps", "120", "--record"],
    "precision": ["bench.precision_bench", "--rows", "1000000", "--record"],
    "dedup": ["bench.dedup_bench", "--rows", "200000", "--steps", "150", "--record"],
    "distributed": ["bench.distributed_bench", "--record"],
    "quality": ["bench.quality_bench", "--record"],
    "predict": ["bench.predict_bench", "--rows", "1000000", "--record"],
    "threads": ["bench.threads_bench", "--record"],
}
QUICK = {
    "preprocess": ["--rows", "200000"],
    "train": ["--rows", "50000", "--steps", "50"],
    "placement": ["--rows", "50000", "--steps", "20"],
    "precision": ["--rows", "100000"],
    "dedup": ["--rows", "20000", "--steps", "20"],
    "distributed": ["--quick"],
    "quality": ["--rows", "20000", "--seeds", "2"],
    "predict": ["--rows", "50000", "--no-export"],
    "threads": ["--rows", "20000", "--steps", "40", "--rounds", "1"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=list(SUITE))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    failed = []
    for name in args.only:
        command = [sys.executable, "-m", *SUITE[name]]
        if args.quick:
            command = [c for c in command if c != "--record"] + QUICK[name]
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        start = time.perf_counter()
        if subprocess.run(command).returncode != 0:
            failed.append(name)
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)
    if failed:
        sys.exit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
