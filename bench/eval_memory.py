"""Evaluation memory: does RSS grow with the batches of an evaluation, or with each evaluation?

    .venv/bin/python -m bench.eval_memory --dataset DIR [--split val] [--evaluations 3]
        [--set OVERRIDE ...] [--record]

Composes `recsys train`'s config (model=dlrm_kaggle, dataset=criteo_kaggle at
DIR, device placement unless --set says otherwise, e.g. `--set
+placement=lookahead --set placement.cache_ratio=0.01 --set +precision=int4`),
builds its trainer on a preprocessed dataset (the headline run's), evaluates
one split several times in a row and reports, for each, the RSS after it, the
peak RSS of its two phases (the prediction loop, then the metrics over the
whole split) and the process's peak so far (a 10 ms sampler thread). The
headline run of 2026-12-01 found the final evaluation taking the process
from 1.55 GB to 8.1 GB; the goal is RSS back near where it was after each
evaluation, and a peak above the built trainer of no more than the
evaluation's working set.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class PeakSampler:
    """The highest RSS seen since the last reset(), sampled every 10 ms on a thread."""

    def __init__(self, rss) -> None:
        self.rss = rss
        self.peak = self.overall = rss()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            now = self.rss()
            self.peak, self.overall = max(self.peak, now), max(self.overall, now)
            time.sleep(0.01)

    def reset(self) -> int:
        """The peak since the last reset; the next one starts from the RSS now."""
        peak = max(self.peak, self.rss())
        self.peak = self.rss()
        return peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--split", default="val")
    parser.add_argument("--evaluations", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="OVERRIDE",
                        help="a `recsys train` override, e.g. --set +precision=int4")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from recsys_cli.config import register_configs
    from recsys_cli.train.memory import current_rss_bytes
    from recsys_cli.train.trainer import Trainer

    overrides = ["dataset=criteo_kaggle", f"dataset.path={args.dataset}", "model=dlrm_kaggle", "trainer.progress=false",
                 "trainer.checkpoint_every=null", "trainer.final_checkpoint=false", "trainer.device=cpu", *args.set]
    from recsys_cli.config_groups import group_overrides

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=group_overrides(overrides))
    trainer = Trainer(cfg)
    sampler = PeakSampler(current_rss_bytes)
    MiB = 2**20
    rows = [{"evaluation": "built", "RSS after MiB": current_rss_bytes() / MiB, "prediction loop peak MiB": None,
             "metrics peak MiB": None, "peak RSS so far MiB": sampler.overall / MiB, "seconds": 0.0, "rows": None}]
    print(rows[-1], flush=True)
    for k in range(1, args.evaluations + 1):
        start = time.perf_counter()
        sampler.reset()
        logits, labels = trainer.predictions(args.split)  # Trainer.evaluate's two phases, each with its peak
        loop_peak = sampler.reset()
        result = trainer.metrics(logits, labels)
        del logits, labels
        metrics_peak = sampler.reset()
        rows.append({"evaluation": k, "RSS after MiB": current_rss_bytes() / MiB,
                     "prediction loop peak MiB": loop_peak / MiB, "metrics peak MiB": metrics_peak / MiB,
                     "peak RSS so far MiB": sampler.overall / MiB, "seconds": time.perf_counter() - start,
                     "rows": result["samples"]})
        print(rows[-1], flush=True)
    if args.record:
        from bench.record import record

        record("Evaluation memory by phase: the prediction loop and the metrics (dlrm_kaggle)",
               list(rows[0]), rows,
               f"python -m bench.eval_memory --dataset {args.dataset} --split {args.split} "
               f"--evaluations {args.evaluations}" + "".join(f" --set {s}" for s in args.set),
               note="One process: the trainer is built (no training), then one split is evaluated again and again; "
                    "each evaluation's two phases (Trainer.predictions, then Trainer.metrics) have their own peak, "
                    "sampled every 10 ms. The command's --set overrides say the placement, precision and eval batch.")


if __name__ == "__main__":
    main()
