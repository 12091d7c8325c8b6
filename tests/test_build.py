"""Tables built in place, chunk by chunk, in their final precision: the values
do not depend on the chunk size, and a low-precision build never holds the
fp32 tables (peak RSS measured in a fresh process, as its own VmHWM: a
child's ru_maxrss starts at its parent's RSS, so under a 1.5 GB test session a
build that held the fp32 tables measured no growth at all)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from recsys_cli.embeddings.quant import INIT_STEP
from recsys_cli.embeddings.store import RowStore
from recsys_cli.embeddings.table_init import TableSpec, build_initial_rows, init_rows

# C2 and C4 span a chunk boundary of the 4,099-row chunks, the rest is odd sizes.
SPECS = [TableSpec("C1", 5, 8), TableSpec("C2", 5_000, 8), TableSpec("C3", 1, 8), TableSpec("C4", 4_321, 8)]


def _store(precision: str, rounding: str = "stochastic") -> RowStore:
    rows = sum(t.num_rows for t in SPECS)
    return RowStore(rows, 8, torch.zeros(rows, 0), precision, rounding, seed=3,
                    table_rows=[(i, t.num_rows) for i, t in enumerate(SPECS)])


def _built(precision: str, chunk_rows: int | None, rounding: str = "stochastic", in_place: bool = True,
           workers: int = 1) -> dict:
    store = _store(precision, rounding)
    build_initial_rows(SPECS, 11, store.write_initial, chunk_rows, into=store.initial_view if in_place else None,
                       workers=workers)
    return store.rows.tensors()


@pytest.mark.parametrize("precision, rounding", [("fp32", "stochastic"), ("fp16", "stochastic"), ("int8", "stochastic"),
                                                 ("int4", "stochastic"), ("int8", "nearest")])
def test_built_tables_do_not_depend_on_the_chunk_size(precision, rounding):
    """Built in chunks of 2, 7, 4096 + 3 or the default rows, in place or
    through write, on one thread or three, the store holds the same bits as a
    store written in one piece from each table's rows drawn one by one
    (another way round)."""
    reference = _store(precision, rounding)
    fp32 = torch.cat([init_rows(t, r, r + 1, seed=11) for t in SPECS for r in range(t.num_rows)])
    ids = torch.arange(fp32.shape[0])
    reference.write(ids, fp32, torch.zeros(ids.numel(), 0), INIT_STEP)  # the store's protocol: rounding keyed by the step
    for chunk_rows, in_place, workers in [(2, True, 1), (7, False, 1), (4099, True, 3), (4099, False, 3),
                                          (None, True, 1), (None, False, 1)]:
        got = _built(precision, chunk_rows, rounding, in_place, workers)
        for name, tensor in reference.rows.tensors().items():
            assert torch.equal(got[name], tensor), (precision, chunk_rows, in_place, workers, name)


_PEAK = textwrap.dedent("""
    import json, sys, torch
    from omegaconf import OmegaConf
    from recsys_cli.config import PlacementConfig, PrecisionConfig
    from recsys_cli.embeddings.optim import RowOptimizer
    from recsys_cli.embeddings.placement import build_embeddings
    from recsys_cli.train.memory import peak_rss_bytes

    torch.set_num_threads(1)
    kind, precision, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def build(n):
        place = OmegaConf.merge(OmegaConf.structured(PlacementConfig), {"kind": kind})
        prec = OmegaConf.merge(OmegaConf.structured(PrecisionConfig), {"kind": precision, "rounding": "nearest"})
        return build_embeddings(["a", "b"], [n // 2, n - n // 2], 16, place, prec, RowOptimizer("sgd"),
                                torch.device("cpu"), 0)
    build(200_000)  # every kernel and allocator pool warmed up
    before = peak_rss_bytes()
    emb = build(rows)
    after = peak_rss_bytes()
    print(json.dumps({"peak_growth": after - before, "bytes": emb.memory()}))
""")


def _peak(kind: str, precision: str, rows: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _PEAK, kind, precision, str(rows)], capture_output=True, text=True,
                         check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind, precision", [("device", "int4"), ("host", "int8"), ("device", "fp32")])
def test_peak_memory_of_a_build_is_the_store_not_the_fp32_tables(kind, precision):
    """Peak RSS of building 3M rows at dim 16 (192 MiB in fp32) in a fresh
    process: the store's own bytes plus a bounded working set (a chunk and the
    quantizer's temporaries), never the fp32 tables nor a concatenated copy."""
    rows = 3_000_000
    fp32_bytes = rows * 16 * 4
    got = _peak(kind, precision, rows)
    held = got["bytes"]["table"] + got["bytes"]["cache"] + got["bytes"]["index"]
    assert got["peak_growth"] <= held + 64 * 2**20, got
    if precision != "fp32":
        assert got["peak_growth"] < fp32_bytes / 2, got
