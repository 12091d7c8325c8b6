"""Same-process A/B of recsys against FBGEMM's TBE and plain PyTorch (BENCHMARKS.md, "Peers").

    make bench-peers ARGS="--batch 128 2048 --record"
    .venv-peers/bin/python -m bench.peers.ab [--batch 128 2048] [--rounds 8] [--optimizer sgd]

For each batch size every system (systems.py) is built in one process, with
one compute thread (torch.set_num_threads(1); --threads N gives every
system N); each reads the same batches
from its own loader. After a warm-up chunk each, the systems run in rounds:
every round runs one chunk of steps per system (order rotated from round
to round), timed end to end (waiting for the next batch included). A round
gives each system's samples/s and recsys's ratio to each peer; the report is
the per-round ratios, their median and range. Ratios from one round share
the machine's load, which is why they are the figure (six processes share
this machine's cores). Then each system runs alone in a fresh process
(--only) and reports its peak RSS (build and training).

The first steps' losses of every system are compared with recsys's: they
start from the same weights, so they agree to float rounding, which checks
that the systems train the same model with the same optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from bench.peers.systems import SYSTEMS, Recsys, Setup, build, dataset_dir, shapes_of
from recsys_cli.train.memory import peak_rss_bytes  # VmHWM: a child's own peak, not its parent's

LOSS_STEPS = 20  # first steps whose losses are compared with recsys's


def chunk(system, batches, steps: int) -> tuple[float, float, list[float]]:
    """Wall seconds and the compute thread's CPU seconds for `steps` steps, and their losses."""
    losses = []
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        losses.append(system.step(next(batches)).detach())
    seconds, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    return seconds, cpu, [float(x) for x in losses]


def run_ab(setup: Setup, names: list[str], rounds: int, steps: int, warmup: int, threads: int = 1) -> dict:
    torch.set_num_threads(threads)  # every system the same count
    cfg = setup.config()
    data = dataset_dir(cfg)
    shapes = shapes_of(cfg, data)
    built = time.perf_counter()
    recsys = Recsys(setup, shapes, data, cfg) if "recsys" in names else None
    systems = {n: build(n, setup, cfg, shapes, data, recsys) for n in names}
    build_seconds = time.perf_counter() - built
    batches = {n: iter(s.loader()) for n, s in systems.items()}
    needed = warmup + rounds * steps
    if needed * setup.batch_size > setup.rows * 0.8:  # the train split is ~80 % of the rows
        raise SystemExit(f"--rows {setup.rows} is too few for {needed} steps of batch {setup.batch_size}")
    first_losses = {}
    for n, s in systems.items():  # warm-up, and the loss check
        _, _, losses = chunk(s, batches[n], warmup)
        first_losses[n] = losses[:LOSS_STEPS]
    per_round, per_round_cpu = [], []
    load = [os.getloadavg()[0]]
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        rates, cpu_rates = {}, {}
        for n in order:
            seconds, cpu, _ = chunk(systems[n], batches[n], steps)
            rates[n] = steps * setup.batch_size / seconds
            cpu_rates[n] = steps * setup.batch_size / cpu
        per_round.append(rates)
        per_round_cpu.append(cpu_rates)
        load.append(os.getloadavg()[0])
        print(f"  round {r + 1}: " + "  ".join(f"{n} {rates[n]:,.0f}/s" for n in names)
              + ("  " + "  ".join(f"recsys/{n} {rates['recsys'] / rates[n]:.3f}" for n in names if n != "recsys")
                 if "recsys" in names else ""), flush=True)
    loss_gap = {n: max((abs(a - b) for a, b in zip(first_losses[n], first_losses["recsys"])), default=None)
                for n in names if n != "recsys" and n != "mlps" and "recsys" in names}
    return {"per_round": per_round, "per_round_cpu": per_round_cpu, "loss_gap": loss_gap, "first_losses": first_losses,
            "load": load, "build_seconds": build_seconds}


def summarize(result: dict, names: list[str]) -> dict:
    """Medians of samples/s and (median, min, max) of recsys's ratios over the
    rounds, end to end (wall clock) and on the compute thread's CPU time."""
    out = {}
    for suffix, rounds in (("", result["per_round"]), (" cpu", result["per_round_cpu"])):
        out["samples_per_second" + suffix] = {n: statistics.median(r[n] for r in rounds) for n in names}
        if "recsys" in names:
            for n in names:
                if n != "recsys":
                    ratios = [r["recsys"] / r[n] for r in rounds]
                    out[f"recsys/{n}{suffix}"] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def peak_rss(setup: Setup, name: str, steps: int, argv: list[str]) -> int | None:
    """Peak RSS (bytes) of `name` built and trained alone in a fresh process."""
    cmd = [sys.executable, "-m", "bench.peers.ab", *argv, "--batch", str(setup.batch_size), "--only", name,
           "--only-steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_bytes"]


def run_only(setup: Setup, name: str, steps: int, threads: int = 1) -> None:
    torch.set_num_threads(threads)
    cfg = setup.config()
    data = dataset_dir(cfg)
    shapes = shapes_of(cfg, data)
    system = build(name, setup, cfg, shapes, data, None)
    batches = iter(system.loader())
    chunk(system, batches, steps)
    print(json.dumps({"system": name, "peak_rss_bytes": peak_rss_bytes()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=None, help="steps per chunk (default: 8192 samples' worth, >= 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per system (default: 2 chunks)")
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--cardinality-scale", type=float, default=1.0)
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adagrad"))
    p.add_argument("--lr", type=float, default=None, help="default: 0.1 (sgd), 0.05 (adagrad)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recsys config overrides")
    p.add_argument("--threads", type=int, default=1, help="compute threads, the same for every system")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS processes")
    p.add_argument("--record", action="store_true", help="append the results to BENCHMARKS.md")
    p.add_argument("--only", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--only-steps", type=int, default=50, help=argparse.SUPPRESS)
    args = p.parse_args()
    lr = args.lr if args.lr is not None else (0.1 if args.optimizer == "sgd" else 0.05)
    common = ["--rows", str(args.rows), "--cardinality-scale", str(args.cardinality_scale),
              "--optimizer", args.optimizer, "--lr", str(lr), "--threads", str(args.threads),
              *(["--set", *args.set] if args.set else [])]

    def setup_for(batch: int) -> Setup:
        return Setup(rows=args.rows, cardinality_scale=args.cardinality_scale, batch_size=batch,
                     optimizer=args.optimizer, lr=lr, overrides=tuple(args.set))

    if args.only:
        run_only(setup_for(args.batch[0]), args.only, args.only_steps, args.threads)
        return
    names = list(args.systems)
    rows = []
    for batch in args.batch:
        steps = args.steps or max(2, 8192 // batch)
        warmup = args.warmup if args.warmup is not None else 2 * steps
        setup = setup_for(batch)
        print(f"batch {batch}: {args.rounds} rounds of {steps} steps per system, {warmup} warm-up steps, "
              f"optimizer {args.optimizer} lr {lr}, {args.threads} compute thread(s)", flush=True)
        result = run_ab(setup, names, args.rounds, steps, max(warmup, 1), args.threads)
        summary = summarize(result, names)
        for n, gap in result["loss_gap"].items():
            print(f"  first {LOSS_STEPS} losses, max |{n} - recsys|: {gap:.2e}")
        for key, value in summary.items():
            if key.startswith("recsys/"):
                what = key.replace(" cpu", " on compute-thread CPU time")
                print(f"  {what}: median {value[0]:.3f} (range {value[1]:.3f}-{value[2]:.3f})")
        print("  median samples/s: " + ", ".join(f"{n} {v:,.0f}" for n, v in summary["samples_per_second"].items()))
        print("  median samples per compute-thread CPU second: "
              + ", ".join(f"{n} {v:,.0f}" for n, v in summary["samples_per_second cpu"].items()))
        rss = {}
        if not args.no_rss:
            for n in names:
                rss[n] = peak_rss(setup, n, max(steps, 20), common)
                if rss[n] is not None:
                    print(f"  peak RSS {n} alone: {rss[n] / 2**30:.2f} GiB", flush=True)
        rows.append({"batch": batch, "summary": summary, "result": result, "rss": rss, "steps": steps})
        del result
    if args.record:
        record(rows, names, args, lr)


def record(rows: list[dict], names: list[str], args, lr: float) -> None:
    from bench.record import record as append

    command = ("make bench-peers ARGS=\"" + " ".join(
        ["--batch", *map(str, args.batch), "--rounds", str(args.rounds), "--optimizer", args.optimizer,
         *(["--rows", str(args.rows)] if args.rows != 300_000 else []),
         *(["--cardinality-scale", str(args.cardinality_scale)] if args.cardinality_scale != 1.0 else []),
         *(["--threads", str(args.threads)] if args.threads != 1 else []),
         *(["--set", *args.set] if args.set else []), "--record"]) + "\"")
    table = []
    for r in rows:
        s, res = r["summary"], r["result"]
        row = {"batch": r["batch"], "optimizer": args.optimizer, "recsys options": " ".join(args.set) or "defaults",
               "rounds x steps": f"{args.rounds} x {r['steps']}"}
        for n in names:
            row[f"{n} samples/s"] = s["samples_per_second"][n]
        for n in names:
            if n != "recsys" and f"recsys/{n}" in s:
                med, lo, hi = s[f"recsys/{n}"]
                row[f"recsys/{n} median (range)"] = f"{med:.3f} ({lo:.3f}-{hi:.3f})"
        for n in names:
            if n != "recsys" and f"recsys/{n} cpu" in s:
                med, lo, hi = s[f"recsys/{n} cpu"]
                row[f"recsys/{n} on CPU time"] = f"{med:.3f} ({lo:.3f}-{hi:.3f})"
        for n in names:
            v = r["rss"].get(n)
            row[f"{n} peak RSS GiB"] = None if v is None else v / 2**30
        row["max loss gap"] = max((g for g in res["loss_gap"].values() if g is not None), default=None)
        row["load avg"] = f"{min(res['load']):.1f}-{max(res['load']):.1f}"
        table.append(row)
    threads = "one compute thread" if args.threads == 1 else f"{args.threads} compute threads, every system"
    append(f"Peers: recsys vs FBGEMM TBE + TorchRec dense arch vs plain PyTorch (dlrm_kaggle, {threads})",
           list(table[0]), table, command,
           note=("Same process, same loader batches, same model, initial values and optimizer; chunks of steps "
                 "alternate between the systems, round after round, each timed end to end through its loader "
                 "(recsys plans lookups on its loader thread, the peers prepare their inputs on theirs). "
                 "Ratios are recsys's samples/s over the peer's in the same round: median and range over the "
                 "rounds. mlps is recsys's dense layers on fixed pooled embeddings (the ceiling). Peak RSS: each "
                 "system alone in a fresh process. Goal (issue 18): recsys/tbe >= 1.25 at batch 128 and >= 1.15 "
                 "at 2048, fp32. The machine is shared (load average column: 1-minute load during the run)."))


if __name__ == "__main__":
    main()
