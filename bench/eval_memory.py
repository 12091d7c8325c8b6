"""Evaluation memory: does RSS grow with the batches of an evaluation, or with each evaluation?

    .venv/bin/python -m bench.eval_memory --dataset DIR [--split val] [--evaluations 3] [--record]

Builds `recsys train`'s trainer for model=dlrm_kaggle with device placement
on a preprocessed dataset (the headline run's), evaluates one split several
times in a row and reports, for each, the RSS after it and the process's
peak RSS so far (a 0.1 s sampler thread: ru_maxrss only ever rises). The
headline run of 2026-12-01 found the final evaluation taking the process
from 1.55 GB to 8.1 GB; the goal is RSS back near where it was after each
evaluation, and a peak above the trained process of no more than the
evaluation's working set.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--split", default="val")
    parser.add_argument("--evaluations", type=int, default=3)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()

    from omegaconf import OmegaConf

    from recsys_cli.config import TrainConfig
    from recsys_cli.train.memory import current_rss_bytes
    from recsys_cli.train.trainer import Trainer

    cfg = OmegaConf.structured(TrainConfig)
    cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(ROOT / "configs" / "model" / "dlrm_kaggle.yaml"))
    cfg.dataset.name, cfg.dataset.path = "criteo_kaggle", args.dataset
    tc = cfg.trainer
    tc.progress, tc.checkpoint_every, tc.final_checkpoint, tc.device = False, None, False, "cpu"
    trainer = Trainer(cfg)
    peak = [current_rss_bytes()]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], current_rss_bytes())
            time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()
    MiB = 2**20
    rows = [{"evaluation": "before", "RSS after MiB": current_rss_bytes() / MiB, "peak RSS so far MiB": peak[0] / MiB,
             "seconds": 0.0, "rows": None}]
    for k in range(1, args.evaluations + 1):
        start = time.perf_counter()
        result = trainer.evaluate(args.split)
        rows.append({"evaluation": k, "RSS after MiB": current_rss_bytes() / MiB,
                     "peak RSS so far MiB": peak[0] / MiB, "seconds": time.perf_counter() - start,
                     "rows": result["samples"]})
        print(rows[-1], flush=True)
    if args.record:
        from bench.record import record

        record("Evaluation memory: RSS through repeated evaluations (dlrm_kaggle, device placement)",
               list(rows[0]), rows,
               f"python -m bench.eval_memory --dataset {args.dataset} --split {args.split} "
               f"--evaluations {args.evaluations}",
               note="One process: the trainer is built (no training), then one split is evaluated again and again "
                    "(eval batch 4096). Before the fix (the headline run's fp32 stage, 2026-12-01) the final "
                    "val + test evaluation raised the process from 1.55 GB to 8.1 GB peak.")


if __name__ == "__main__":
    main()
