"""Placement benchmark (cDLRM): lookahead against device placement, one run.

    .venv/bin/python -m bench.placement_bench [--rows 400000] [--steps 150] [--record]

1. Throughput of lookahead at cache_ratio 0.05 and 0.01 against device, same data.
2. Overhead per step against window (1..64) and cache size (caches that hold
   about 2.4 and 10 batches' rows): cDLRM's trade-off.
3. Hit rate against cache size for an on-demand cache with LRU and LFU.
Data: synthetic, Kaggle cardinalities (33.8M rows) with Zipf skew; dlrm_kaggle.
"""

from __future__ import annotations

import argparse

from omegaconf import OmegaConf

from bench.train_bench import recsys_config, time_recsys
from recsys_cli.train.trainer import Trainer


def throughput(rows: int, steps: int, batch: int, placement: dict) -> dict:
    cfg = recsys_config(rows, batch, steps, placement)
    rate, summary = time_recsys(cfg)
    cache = summary.get("cache") or {}
    return {
        "samples/s": rate,
        "ms/step": 1000 * batch / rate,
        "hit rate": cache.get("hit_rate"),
        "window used": cache.get("window_used_mean"),
        "device MiB": summary["embedding_bytes"]["device"] / 2**20,
        "host MiB": summary["embedding_bytes"]["host"] / 2**20,
    }


def hit_rates(rows: int, batch: int, ratios: list[float], batches: int = 400) -> list[dict]:
    """Replay the same batches through an on-demand cache; no training needed for hit rates."""
    out = []
    for policy in ("lru", "lfu"):
        for ratio in ratios:
            cfg = recsys_config(rows, batch, 1, {"kind": "cache", "cache_ratio": ratio, "policy": policy})
            trainer = Trainer(cfg)
            group = trainer.embeddings.groups[0]
            for i, b in enumerate(trainer.train_loader):
                if i == batches:
                    break
                plan = b.plans[0]
                group.prepare(plan)
                group.release(plan)
            out.append({"policy": policy, "cache ratio": ratio, "hit rate": group.stats()["hit_rate"]})
            print(out[-1], flush=True)
    return out


def run(rows: int, steps: int, batch: int):
    base = throughput(rows, steps, batch, {"kind": "device"})
    table1 = [{"placement": "device", **base, "vs device": 1.0}]
    for ratio in (0.05, 0.01):
        r = throughput(rows, steps, batch, {"kind": "lookahead", "cache_ratio": ratio, "window": 4})
        table1.append({"placement": f"lookahead {ratio:.0%}", **r, "vs device": r["samples/s"] / base["samples/s"]})
        print(table1[-1], flush=True)
    # cDLRM's trade-off needs caches the window can overflow: a batch of 1024
    # touches about 8.2k unique rows, so these hold ~2.4 and ~10 batches' rows.
    table2 = []
    for cache_rows in (20_000, 80_000):
        for window in (1, 2, 4, 8, 16, 32, 64):
            r = throughput(rows, steps, batch, {"kind": "lookahead", "cache_rows": cache_rows, "window": window})
            table2.append({"cache rows": cache_rows, "window": window, "ms/step": r["ms/step"],
                           "overhead ms/step": r["ms/step"] - base["ms/step"], "window used": r["window used"],
                           "hit rate": r["hit rate"]})
            print(table2[-1], flush=True)
    table3 = hit_rates(rows, batch, [0.0005, 0.001, 0.002, 0.005, 0.01], batches=300)
    return table1, table2, table3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    t1, t2, t3 = run(args.rows, args.steps, args.batch)
    if args.record:
        from bench.record import record

        cmd = f"python -m bench.placement_bench --rows {args.rows} --steps {args.steps} --batch {args.batch}"
        record("Placement: lookahead vs device (dlrm_kaggle, Kaggle cardinalities)", list(t1[0]), t1, cmd,
               note="Goal on CPU: lookahead at 5 % cache >= 0.9x device, at 1 % >= 0.75x.")
        record("Placement: lookahead overhead by window and cache size", list(t2[0]), t2, cmd,
               note="Overhead = ms/step minus device placement's ms/step in the same run.")
        record("Placement: hit rate by cache size and policy (on-demand cache)", list(t3[0]), t3, cmd)


if __name__ == "__main__":
    main()
