"""Table build rate (issue 41 item 4): an int4 table built as `recsys train` builds it, old hashing against new.

    .venv/bin/python -m bench.table_build_bench [--rows 400000] [--rounds 3]

Builds one dim-128 int4 table (a RowStore, row-wise Adagrad's state beside
it) with table_init.build_initial_rows on every core, as placement.py does,
alternating in one process between the rounding hashes as they were
(per-element rounds in int64, counter.fmix32) and as they are (int32,
counter.fmix32_int32_), so the machine's load weighs on both alike. Prints
values/s of each round, the median ratio, and checks that both builds give
the same bits (torch.equal). At MLPerf DLRM-DCNv2's size (204,184,588 rows x
128 = 26.1G values) the build takes 26.1G / (values/s).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from recsys_cli.embeddings import quant
from recsys_cli.embeddings.counter import MASK32, fmix32
from recsys_cli.embeddings.store import RowStore
from recsys_cli.embeddings.table_init import TableSpec, build_initial_rows

MLPERF_VALUES = 204_184_588 * 128


def int64_hashes(key: quant.RoundingKey, width: int) -> torch.Tensor:
    """The per-element hashes as they were computed before (int64 rounds)."""
    row = key.row
    step = torch.as_tensor(key.step, dtype=torch.int64).expand(row.shape)
    h = torch.full(row.shape, key.seed & MASK32, dtype=torch.int64)
    for word in (key.table & MASK32, row & MASK32, row >> 32, step & MASK32):
        h = fmix32(h ^ word ^ 0x9E3779B9)
    return fmix32(fmix32(h.unsqueeze(1) ^ torch.arange(width, dtype=torch.int64)))


def build(rows: int, hashes) -> tuple[float, RowStore]:
    spec = TableSpec("C1", rows, 128)
    store = RowStore(rows, 128, torch.zeros(rows, 1), precision="int4", seed=0, table_rows=[(0, rows)])
    saved = quant.RoundingKey.hashes
    quant.RoundingKey.hashes = hashes  # type: ignore[method-assign]
    try:
        began = time.perf_counter()
        build_initial_rows([spec], 0, store.write_initial, into=store.initial_view, workers=torch.get_num_threads())
        return time.perf_counter() - began, store
    finally:
        quant.RoundingKey.hashes = saved  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    new_hashes = quant.RoundingKey.hashes
    ratios = []
    for r in range(args.rounds):
        old_s, old_store = build(args.rows, int64_hashes)
        new_s, new_store = build(args.rows, new_hashes)
        for name, t in old_store.rows.tensors().items():
            assert torch.equal(t, new_store.rows.tensors()[name]), name
        values = args.rows * 128
        ratios.append(old_s / new_s)
        print(f"round {r}: int64 hashes {values / old_s / 1e6:.1f}M values/s, int32 {values / new_s / 1e6:.1f}M "
              f"values/s, {old_s / new_s:.2f}x, equal", flush=True)
    print(f"median {statistics.median(ratios):.2f}x on {torch.get_num_threads()} threads; MLPerf's tables "
          f"({MLPERF_VALUES / 1e9:.1f}G values) at the last round's rate: {MLPERF_VALUES * new_s / values:.0f} s")


if __name__ == "__main__":
    main()
