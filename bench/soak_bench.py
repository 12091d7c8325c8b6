"""Soak benchmark (issue 18, goal 7): does resident memory grow with the run?

    .venv/bin/python -m bench.soak_bench [--rows 3000000] [--short 3000] [--long 30000] [--record]
        [--dataset DIR] [--long-run RUN_DIR] [--final-eval]

Trains the same configuration (device placement, no checkpoints, no
evaluation, one epoch long enough for the long run) for `--short` and for
`--long` steps, each in its own process, and reports each process's peak RSS
(VmHWM) and the RSS samples summary.json records at every log step. The
goal: peak RSS at many steps within 10 % of the peak at few steps. The issue's
full scale is 3k vs 300k steps of model=dlrm_kaggle; the defaults here (a
small model, 30k steps) fit a few minutes on two cores, and the same loader,
step and allocator paths run.

`--dataset DIR` trains on a preprocessed dataset instead of synthetic rows.
`--long-run RUN_DIR` takes the long run from a finished `recsys train` run of
the same configuration (its summary.json: steps, peak RSS, the RSS trace)
instead of training it again: the headline's fp32 run (bench/headline.py) is
one epoch of 307k steps, device placement, no checkpoints, with a final test
evaluation on top, which its peak includes: `--final-eval` ends the short
run with the same evaluation, so the two peaks compare like with like. The
"training peak" columns are the highest RSS sample of the trace summary.json
records at log steps, before any final evaluation.

`--child` runs one length and prints a JSON line (used by the parent).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    from omegaconf import OmegaConf

    from recsys_cli.config import TrainConfig
    from recsys_cli.train.memory import peak_rss_bytes
    from recsys_cli.train.trainer import Trainer

    cfg = OmegaConf.structured(TrainConfig)
    model = OmegaConf.load(ROOT / "configs" / "model" / f"{args.model}.yaml")
    cfg.model = OmegaConf.merge(cfg.model, model)
    cfg.dataset.synthetic.rows = args.rows
    cfg.dataset.synthetic.cardinality_scale = args.cardinality_scale
    if args.dataset:
        cfg.dataset.name, cfg.dataset.path = "criteo_kaggle", args.dataset
    tc = cfg.trainer
    tc.batch_size, tc.max_steps, tc.epochs = args.batch, args.steps, 1
    tc.checkpoint_every, tc.eval_every, tc.log_every, tc.progress = None, None, args.log_every, False
    tc.device = args.device
    trainer = Trainer(cfg)
    if not args.final_eval:
        trainer.eval_loaders = {}
    t0 = time.perf_counter()
    summary = trainer.fit()
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes() / 2**20
    print(json.dumps({"steps": summary["steps"], "peak_rss_mib": peak, "seconds": seconds,
                      "rss": [[step, b / 2**20] for step, b in summary["memory"]["rss_bytes"]]}), flush=True)


def run_child(args, steps: int, env: dict) -> dict:
    cmd = [sys.executable, "-m", "bench.soak_bench", "--child", "--steps", str(steps), "--rows", str(args.rows),
           "--cardinality-scale", str(args.cardinality_scale), "--model", args.model, "--batch", str(args.batch),
           "--log-every", str(args.log_every), "--device", args.device]
    if args.dataset:
        cmd += ["--dataset", args.dataset]
    if args.final_eval:
        cmd.append("--final-eval")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def finished(run_dir: Path) -> dict:
    """A finished run's figures, as a child reports them."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"steps": summary["steps"], "peak_rss_mib": summary["peak_host_rss_bytes"] / 2**20,
            "seconds": summary["train_seconds"],
            "rss": [[step, b / 2**20] for step, b in summary["memory"]["rss_bytes"]]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--cardinality-scale", type=float, default=0.002)
    parser.add_argument("--short", type=int, default=3000)
    parser.add_argument("--long", type=int, default=30000)
    parser.add_argument("--model", default="dlrm_small")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--log-every", type=int, default=500)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--dataset", default=None, help="a preprocessed dataset directory")
    parser.add_argument("--long-run", type=Path, default=None,
                        help="a finished run of the same configuration to take as the long run (its summary.json)")
    parser.add_argument("--final-eval", action="store_true",
                        help="end each run with recsys train's final val/test evaluation (as --long-run's run did)")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if args.child:
        return child(args)
    env = {**os.environ}
    rows = []
    for steps in (args.short, args.long):
        r = run_child(args, steps, env) if steps == args.short or args.long_run is None else finished(args.long_run)
        trace = r["rss"]
        rows.append({"steps": r["steps"], "peak RSS MiB": r["peak_rss_mib"],
                     "training peak MiB (RSS trace)": max(b for _, b in trace) if trace else float("nan"),
                     "RSS at first log MiB": trace[0][1] if trace else float("nan"),
                     "RSS at last log MiB": trace[-1][1] if trace else float("nan"),
                     "seconds": r["seconds"]})
        print(rows[-1], flush=True)
    ratio = rows[1]["peak RSS MiB"] / rows[0]["peak RSS MiB"]
    trained = "training peak MiB (RSS trace)"
    for r in rows:
        r["peak vs short"] = r["peak RSS MiB"] / rows[0]["peak RSS MiB"]
        r["training peak vs short"] = r[trained] / rows[0][trained]
    print(f"peak RSS at {rows[1]['steps']} steps / at {rows[0]['steps']} steps: {ratio:.3f} (goal <= 1.10); "
          f"training alone (RSS trace): {rows[1][trained] / rows[0][trained]:.3f}")
    if args.record:
        from bench.record import record

        cmd = (f"python -m bench.soak_bench --rows {args.rows} --short {args.short} --long {args.long} "
               f"--model {args.model} --batch {args.batch}"
               + (f" --dataset {args.dataset}" if args.dataset else "")
               + (f" --long-run {args.long_run}" if args.long_run else "")
               + (" --final-eval" if args.final_eval else ""))
        load = os.getloadavg()[0]
        record("Soak: peak RSS at many steps vs few (issue 18, goal 7)", list(rows[0]), rows, cmd,
               note=f"Each length in its own process, device placement, no checkpoints, no evaluation unless "
                    f"the command says --final-eval, "
                    f"{args.model}, batch {args.batch}; load average {load:.1f} on the shared machine. "
                    f"Goal: the long run's peak within 10 % of the short run's."
                    + (f" The long run is {args.long_run} (a finished run of the same configuration, whose "
                       f"peak includes its final test evaluation)." if args.long_run else ""))


if __name__ == "__main__":
    main()
