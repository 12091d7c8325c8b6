"""Cache index benchmark: host bytes per slot of a cache's index (issue 27, item 9).

    .venv/bin/python -m bench.cache_index_bench [--rows 2000000] [--ratio 0.05] [--batches 300] [--record]

Builds one int8 table of --rows rows (dim 16) behind an LRU cache of --ratio
of its rows, fills it and runs --batches batches of 4096 power-law ids
(prepare + release, as training does), then measures the tensors of the
index structures themselves: the row -> slot map (SlotIndex), the victim
order (SlotOrder: its entries and scratch, the most over the run) and the
rest of the per-slot metadata memory() counts as "index" (row_of_slot,
dirty, score, free_slots, the room search's scratch; pins in debug runs).
memory()'s index line includes the victim order as it is at the end (since
issue 27 item 9), so that is taken out of "other" and its peak put in "all".
Bytes per slot = bytes / cache slots. Also the mean milliseconds of a prepare, on one compute thread (the machine
may be shared: the load average is recorded).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from recsys_cli.embeddings.cache import CachedGroup
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.plan import plan_lookup
from recsys_cli.embeddings.store import RowStore
from recsys_cli.embeddings.table_init import TableSpec, build_initial_rows

BATCH = 4096


def _plan(values: torch.Tensor):
    return plan_lookup(values, torch.ones(values.numel(), dtype=torch.int64), torch.tensor([values.numel()]),
                       torch.zeros(1, dtype=torch.int64))


def measure(rows: int, ratio: float, batches: int, seed: int = 0) -> dict:
    spec = TableSpec("t", rows, 16)
    optimizer = RowOptimizer("sgd", 0.1)
    store = RowStore(rows, 16, optimizer.initial_state(rows, torch.device("cpu")), "int8")
    build_initial_rows([spec], 0, store.write_initial, into=store.initial_view)
    slots = int(rows * ratio)
    group = CachedGroup(tables=[spec], feature_tables=["t"], store=store, optimizer=optimizer,
                        device=torch.device("cpu"), cache_slots=slots, policy="lru", lookahead=False, window=1,
                        admit_all=True, store_tier="host")
    gen = torch.Generator().manual_seed(seed)
    order_peak, seconds = 0, 0.0
    for b in range(batches):
        ids = (torch.rand(BATCH, generator=gen) ** 3 * rows).long()  # a power law: a hot head, a long tail
        plan = _plan(ids)
        t0 = time.perf_counter()
        group.prepare(plan)
        seconds += time.perf_counter() - t0
        group.release(plan)
        order_peak = max(order_peak, group.victims.nbytes())
    index_line = sum(n for _, what, n in group.memory() if what == "index")
    order_now = group.victims.nbytes()  # in memory()'s index line: the order as it is now
    slot_index = group.slot_index.nbytes()
    return {
        "rows": rows, "cache slots": slots, "resident": slots - group.num_free,
        "slot map B/slot": slot_index / slots,
        "victim order B/slot (peak)": order_peak / slots,
        "map + victim order B/slot": (slot_index + order_peak) / slots,
        "other metadata B/slot": (index_line - slot_index - order_now) / slots,
        "all index B/slot": (index_line - order_now + order_peak) / slots,
        "hit rate": group.stats()["hit_rate"],
        "prepare ms": 1000 * seconds / batches,
        "load average": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one compute thread: the timing of a shared machine's cores varies less
    result = measure(args.rows, args.ratio, args.batches)
    for k, v in result.items():
        print(f"{k:28} {v:,.2f}" if isinstance(v, float) else f"{k:28} {v:,}")
    if args.record:
        from bench.record import record

        record("Cache index bytes per slot (issue 27)", list(result), [result],
               "python -m bench.cache_index_bench " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "record"),
               note="Host bytes of a cache's index structures per cache slot, int8 table of dim 16 behind an LRU "
                    "cache, after the given batches of 4096 power-law ids; tensor bytes of each structure.")


if __name__ == "__main__":
    main()
