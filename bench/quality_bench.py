"""Model quality: test AUC, log loss and normalized entropy over several seeds.

    .venv/bin/python -m bench.quality_bench [--rows 100000] [--seeds 3] [--epochs 1]
        [--dataset-path DIR] [--only NAME ...] [--threads 1] [--record]

Every system trains the Criteo Kaggle reference architecture (dlrm_kaggle:
16-dim tables, bottom 13-512-256-64-16, top 512-256-1) with SGD lr 0.1 at
batch 128, the reference's settings, on the same data and the same seeds,
changing one thing at a time against the first system:

  dot, dlrm init        the default: DLRM's dot interaction and reference init
  dot, torch init       nn.Linear's default init (model.init=torch)
  dcn, dlrm init        DCNv2 cross layers (3, rank 64) instead of dot
  int8 + 5 % cache      int8 tables behind a 5 % fp32 cache
  int4 + 1 % cache      int4 tables behind a 1 % fp32 cache
  lookahead 5 %         host tables behind the lookahead cache (exact: the
                        same numbers as device placement, by construction)

The data: the built-in synthetic generator (--rows rows, Kaggle cardinality
profile x --cardinality-scale, 80/10/10 split) or a preprocessed dataset
given with --dataset-path (e.g. `recsys preprocess criteo` output). Each row
of the table is one system over the seeds: mean +- sample sd, and the
per-seed test AUCs. The "vs first" column is the mean over seeds of the
per-seed AUC difference to the first system (paired: same data, same seed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from recsys_cli.config import TrainConfig
from recsys_cli.train.trainer import Trainer

SYSTEMS: dict[str, dict] = {
    "dot, dlrm init": {},
    "dot, torch init": {"model.init": "torch"},
    "dcn, dlrm init": {"model.interaction": "dcn", "model.dcn_layers": 3, "model.dcn_rank": 64},
    "int8 + 5 % cache": {"precision.kind": "int8", "precision.cache_ratio": 0.05},
    "int4 + 1 % cache": {"precision.kind": "int4", "precision.cache_ratio": 0.01},
    "lookahead 5 %": {"placement.kind": "lookahead", "placement.cache_ratio": 0.05},
}


def make_config(args, seed: int, overrides: dict):
    cfg = OmegaConf.structured(TrainConfig)
    OmegaConf.update(cfg, "model", OmegaConf.load("configs/model/dlrm_kaggle.yaml"), merge=True)
    cfg.model.features = None  # any dataset's sparse features
    if args.dataset_path:
        cfg.dataset.name, cfg.dataset.path = "given", args.dataset_path
    else:
        cfg.dataset.synthetic.rows = args.rows
        cfg.dataset.synthetic.cardinality_scale = args.cardinality_scale
    cfg.optimizer.name, cfg.optimizer.lr = "sgd", 0.1
    cfg.trainer.batch_size = 128
    cfg.trainer.epochs = args.epochs
    cfg.trainer.threads = args.threads or None  # 0: the trainer's default (train/threads.py)
    cfg.trainer.seed = seed
    cfg.trainer.progress = False
    cfg.trainer.checkpoint_every = None  # no mid-run checkpoint pause (the schema's default is every 1000 steps)
    cfg.trainer.log_every = 1_000_000
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def train(cfg) -> dict:
    summary = Trainer(cfg).fit()
    test = summary["final"].get("test") or summary["final"]["val"]
    return {"auc": test["auc"], "logloss": test["logloss"], "ne": test["normalized_entropy"],
            "calibration": test["calibration"], "steps": summary["steps"]}


def mean_sd(values: list[float], digits: int = 4) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--cardinality-scale", type=float, default=0.001)
    parser.add_argument("--dataset-path", default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=list(SYSTEMS))
    # One thread: on a shared 2-core machine two torch threads wait on each
    # other at every op (13x slower steps measured under load).
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: the trainer's default rule)")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in SYSTEMS if n in args.only]
    results: dict[str, list[dict]] = {n: [] for n in names}
    start = time.perf_counter()
    for seed in range(args.seeds):  # seed by seed, so a cut-short run still compares like with like
        for name in names:
            r = train(make_config(args, seed, SYSTEMS[name]))
            results[name].append(r)
            print(f"seed {seed} {name:18s} test AUC {r['auc']:.4f} logloss {r['logloss']:.4f} NE {r['ne']:.4f} "
                  f"calibration {r['calibration']:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    first = results[names[0]]
    rows = []
    for name in names:
        runs = results[name]
        aucs = [r["auc"] for r in runs]
        paired = [r["auc"] - f["auc"] for r, f in zip(runs, first)]
        rows.append({
            "system": name, "seeds": len(runs), "steps": runs[0]["steps"], "test AUC": mean_sd(aucs),
            "vs first": f"{statistics.fmean(paired):+.4f}", "log loss": mean_sd([r["logloss"] for r in runs]),
            "NE": mean_sd([r["ne"] for r in runs]),
            "calibration": f"{statistics.fmean([r['calibration'] for r in runs]):.3f}",
            "AUC per seed": " ".join(f"{a:.4f}" for a in aucs),
        })
    for r in rows:
        print(r, flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.record:
        from bench.record import record

        data = f"--dataset-path {args.dataset_path}" if args.dataset_path else \
            f"--rows {args.rows} --cardinality-scale {args.cardinality_scale}"
        cmd = f"python -m bench.quality_bench {data} --seeds {args.seeds} --epochs {args.epochs}"
        record("Quality: test AUC, log loss and NE over seeds (dlrm_kaggle, SGD lr 0.1, batch 128)", list(rows[0]),
               rows, cmd, note="One system per row, one change against the first row, the same data and seeds. "
                               "mean ± sd over seeds; 'vs first' is the mean paired AUC difference to the first "
                               "row. Goal: dlrm init >= torch init.")


if __name__ == "__main__":
    main()
