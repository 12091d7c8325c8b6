"""The cache's fill work: CachedGroup.prepare() per batch, and its parts, on CPU.

    python -m bench.cache_fill_bench [--batch 16384] [--rows 800000] [--ratios 0.01 0.05] [--batches 39] [--record]

On a GPU the trainer's host work per step is small, and the lookahead
prefetcher's prepare() may set the pace (BENCHMARKS.md, "GPU": lookahead 1 %
ran at 0.68x device placement at batch 16384). This times prepare() alone:
dlrm_kaggle's 26 tables at Kaggle cardinalities (33.8M rows at scale 1, dim
16, row-wise Adagrad) in one lookahead group, built as `recsys train` builds
it, fed the synthetic Kaggle data's batches in order, each gathered,
updated (a zero gradient: its rows dirty, as after a step) and released
right after its prepare (a trainer that keeps up: the prefetcher never
waits). Per cache ratio: the mean ms a batch after the first 10 (periodic
work such as the victim order's rebuild included) and the mean ms of each
part, timed by wrapping the slot index's lookup and insert, the room
search, the eviction (with its write-back), the store's read and the
victim order's push; "other" is the rest of prepare() (its own tensor work
between the parts). "torch ops" counts the torch calls one prepare() makes,
over COUNTED_BATCHES more batches after the timed ones (counting slows each
call, so those are not timed): on a GPU the prefetcher's thread and the
trainer's take turns holding the GIL at every op, so the count is the
prefetcher's share of the trainer's host time, on any machine. The defaults
read one epoch of the training split.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch
from omegaconf import OmegaConf
from torch.overrides import TorchFunctionMode

from bench.timing import time_calls

WARM_BATCHES = 10
COUNTED_BATCHES = 4
PARTS = {  # part -> (object path from the group, method)
    "lookup": ("slot_index", "lookup"),
    "insert": ("slot_index", "insert"),
    "room search": ("", "_make_room"),
    "evict": ("", "_evict"),
    "store read": ("store", "read"),
    "victim order": ("victims", "push"),
}


def group_and_plans(args, ratio: float):
    from recsys_cli import ShardLoader, load_manifest
    from recsys_cli.config import TrainConfig
    from recsys_cli.embeddings.optim import RowOptimizer
    from recsys_cli.embeddings.placement import build_embeddings
    from recsys_cli.train.training_data import resolve_dataset

    cfg = OmegaConf.structured(TrainConfig)
    cfg.dataset.synthetic.rows = args.rows
    cfg.dataset.synthetic.cardinality_scale = args.cardinality_scale
    cfg.dataset.cache_dir = args.cache_dir
    cfg.placement.kind, cfg.placement.cache_ratio = "lookahead", ratio
    data = resolve_dataset(cfg.dataset)
    manifest = load_manifest(data)
    features = [f.name for f in manifest.sparse_features]
    vocab = [f.vocab_size for f in manifest.sparse_features]
    embeddings = build_embeddings(features, vocab, 16, cfg.placement, cfg.precision, RowOptimizer("adagrad", 0.05),
                                  torch.device("cpu"), 0, batch_ids={f: args.batch for f in features})
    loader = ShardLoader(data, "train", args.batch, shuffle=False)
    plans = []
    while len(plans) < args.batches + COUNTED_BATCHES:
        for batch in loader:
            plans.append(embeddings.plan_batch(batch).plans[0])
            if len(plans) == args.batches + COUNTED_BATCHES:
                break
    (group,) = embeddings.groups
    return group, plans


def timed_parts(group) -> dict[str, float]:
    """Each part's method on its object (this run's group only) timed: the
    returned totals grow by the seconds of every call."""
    totals: dict[str, float] = {}
    for part, (path, method) in PARTS.items():
        owner = getattr(group, path) if path else group
        if owner is not None:
            time_calls(owner, method, totals, part)
    return totals


class _OpCount(TorchFunctionMode):
    """Counts the torch calls made from Python while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _step(group, plan) -> None:
    """After a plan's prepare: gather, update (a zero gradient: its rows dirty, written
    back on eviction) and release, as a trainer that keeps up."""
    rows = group.gather(plan)
    group.update(plan, rows, torch.zeros_like(rows))
    group.release(plan)


def ops_per_prepare(group, plans) -> float:
    """The mean torch calls of one prepare() over `plans`, each then stepped."""
    counts = []
    for plan in plans:
        with _OpCount() as counted:
            group.prepare(plan)
        counts.append(counted.count)
        _step(group, plan)
    return statistics.fmean(counts)


def prepare_timed(group, plans, totals: dict[str, float]):
    """Prepare, step (a zero gradient: the rows dirty, written back on
    eviction) and release each plan, as a prefetcher whose trainer keeps up;
    each plan's prepare() seconds, and its parts' seconds by part."""
    whole, parts = [], defaultdict(list)
    for plan in plans:
        before = dict(totals)
        start = time.perf_counter()
        group.prepare(plan)
        whole.append(time.perf_counter() - start)
        for part in PARTS:
            parts[part].append(totals.get(part, 0.0) - before.get(part, 0.0))
        _step(group, plan)
    return whole, parts


def measure(args, ratio: float) -> dict:
    group, plans = group_and_plans(args, ratio)
    whole, parts = prepare_timed(group, plans[: args.batches], timed_parts(group))
    ms = lambda xs: 1000 * statistics.fmean(xs[WARM_BATCHES:])  # noqa: E731
    row = {"cache ratio": ratio, "slots": group.capacity, "ids a batch": int(plans[0].inverse.numel()),
           "unique a batch": round(statistics.fmean(p.unique.numel() for p in plans[WARM_BATCHES:])),
           "hit rate": group.stats()["hit_rate"], "prepare ms": ms(whole)}
    for part in PARTS:
        row[f"{part} ms"] = ms(parts[part])
    row["other ms"] = ms([t - sum(parts[p][i] for p in PARTS) for i, t in enumerate(whole)])
    row["torch ops"] = ops_per_prepare(group, plans[args.batches :])
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_fill_bench")
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=800_000)
    parser.add_argument("--cardinality-scale", type=float, default=1.0)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.05])
    parser.add_argument("--batches", type=int, default=39)
    parser.add_argument("--cache-dir", default=None, help="where the generated data goes (dataset.cache_dir)")
    parser.add_argument("--record", action="store_true", help="append the rows to BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.batches <= WARM_BATCHES:
        parser.error(f"--batches must exceed the {WARM_BATCHES} warm-up batches")
    from bench.record import Load, record

    load_start = Load.now()
    rows = [measure(args, r) for r in args.ratios]
    columns = list(rows[0])
    for row in rows:
        print("  ".join(f"{c} {row[c]:.3g}" if isinstance(row[c], float) else f"{c} {row[c]:,}" for c in columns))
    if args.record:
        command = " ".join(["python -m bench.cache_fill_bench", *(argv if argv is not None else sys.argv[1:])])
        record("Cache fill: prepare() per batch and its parts (CPU)", columns, rows, command,
               note=__doc__.split("\n\n")[2].replace("\n", " ") if __doc__ else "",
               load=Load(load_start, Load.now()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
