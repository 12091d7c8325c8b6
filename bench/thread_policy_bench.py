"""The thread default's evidence: compute threads x OpenMP wait policy, idle and beside a competitor.

    .venv/bin/python -m bench.thread_policy_bench [--steps 300] [--rounds 2] [--competitors 0 1]
        [--policies default spin=1000] [--models dlrm_kaggle:1024 ...] [--record]

The OpenMP wait policy is read once, when the runtime starts, so each policy
runs in its own child process (OMP_WAIT_POLICY set, or removed for the
runtime's own default); inside a child the thread counts alternate run by
run in rounds, so a change in the machine's load hits every count alike.
Policies alternate child by child. "Beside a competitor" starts that many
CPU-bound processes (a busy loop each) for the children's whole life: what a
shared machine, or a second job on a user's workstation, looks like. Each
figure is the trainer's steady-state samples/s (train/throughput.py), with
the loader thread running; the table gives each setting's median and its
ratio to the best setting of its model, batch and competitor count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = (("dlrm_small", 256), ("dlrm_kaggle", 128), ("dlrm_kaggle", 2048))
# The OpenMP runtime's own default, sleeping waits, and (--policies spin=N) torch's
# libgomp spinning N times before it sleeps (GOMP_SPINCOUNT; its default spins ~300,000).
POLICIES = ("default", "PASSIVE")
BUSY_LOOP = "while True: pass"


def child(model: str, batch: int, rows: int, steps: int, rounds: int, threads: list[int]) -> dict[int, list[float]]:
    """In this process (its wait policy fixed): rates per thread count, alternated in rounds."""
    from bench.threads_bench import config, steady_rate

    rates: dict[int, list[float]] = {n: [] for n in threads}
    for r in range(rounds):
        for n in threads if r % 2 == 0 else threads[::-1]:
            rates[n].append(steady_rate(config(model, batch, rows, steps, n)))
    return rates


def run_child(policy: str, model: str, batch: int, rows: int, steps: int, rounds: int, threads: list[int]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    if policy.startswith("spin="):
        env["GOMP_SPINCOUNT"] = policy[len("spin="):]
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-m", "bench.thread_policy_bench", "--child", model, str(batch),
                          "--rows", str(rows), "--steps", str(steps), "--rounds", str(rounds),
                          "--threads", *map(str, threads)],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def run(rows: int, steps: int, rounds: int, competitors: list[int], threads: list[int],
        policies: tuple[str, ...] = POLICIES, models: tuple[tuple[str, int], ...] = MODELS) -> list[dict]:
    out = []
    for busy in competitors:
        loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(busy)]
        try:
            for model, batch in models:
                model_steps = steps if batch <= 256 else max(20, steps // 8)
                rates: dict[tuple[str, int], list[float]] = {}
                for i, policy in enumerate(policies if busy % 2 == 0 else policies[::-1]):
                    for n, r in run_child(policy, model, batch, rows, model_steps, rounds, threads).items():
                        rates.setdefault((policy, n), []).extend(r)
                best = max(statistics.median(r) for r in rates.values())
                load = os.getloadavg()[0]
                for (policy, n), r in sorted(rates.items()):
                    med = statistics.median(r)
                    out.append({"model": model, "batch": batch, "competitors": busy, "policy": policy,
                                "threads": n, "median samples/s": med, "min": min(r), "max": max(r),
                                "vs best": med / best, "load avg (1 min)": load})
                    print(out[-1], flush=True)
        finally:
            for p in loops:
                p.kill()
                p.wait()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "BATCH"), help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--competitors", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 .. the cores")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES),
                        help="default, PASSIVE, ACTIVE or spin=N (GOMP_SPINCOUNT=N)")
    parser.add_argument("--models", nargs="+", default=[f"{m}:{b}" for m, b in MODELS], metavar="MODEL:BATCH")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if args.child:
        rates = child(args.child[0], int(args.child[1]), args.rows, args.steps, args.rounds, args.threads)
        print(json.dumps(rates))
        return
    from recsys_cli.train.threads import available_cores

    threads = args.threads or list(range(1, available_cores() + 1))
    models = tuple((m, int(b)) for m, b in (spec.split(":") for spec in args.models))
    rows = run(args.rows, args.steps, args.rounds, args.competitors, threads, tuple(args.policies), models)
    if args.record:
        from bench.record import record

        record("Compute threads x OpenMP wait policy, idle and beside CPU-bound competitors",
               list(rows[0]), rows,
               f"python -m bench.thread_policy_bench --steps {args.steps} --rounds {args.rounds} "
               f"--competitors {' '.join(map(str, args.competitors))}"
               + (f" --policies {' '.join(args.policies)}" if tuple(args.policies) != POLICIES else "")
               + (f" --models {' '.join(args.models)}" if models != MODELS else ""),
               note="Each wait policy in its own child process (the runtime reads OMP_WAIT_POLICY once), thread "
                    "counts alternated inside it; 'competitors': busy-loop processes running meanwhile; 'vs best': "
                    "the median against the best setting of the same model, batch and competitors.")


if __name__ == "__main__":
    main()
