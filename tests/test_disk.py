"""The disk tier: tables in a file behind a bounded host cache behind the lookahead cache.

Exactness is tested against `device` (fp32) and against the same cache over
a host store (low precision): the disk store keeps the same bits, so it must
train to the same bits."""

import pytest
import torch

from embedding_harness import build, make_batches, run, train
from test_placement_exact import SMALL_CACHE, assert_equal

BATCHES = make_batches(40, batch_size=16)
TINY_HOST_CACHE = 8  # a batch writes back more rows than this: the host cache evicts every step


@pytest.fixture(scope="module", params=["sgd", "adagrad"])
def reference(request):
    return request.param, run(BATCHES, {"kind": "device"}, optimizer=request.param)


@pytest.mark.parametrize("placement", [
    {"kind": "disk", "cache_rows": SMALL_CACHE, "window": 1, "host_cache_rows": TINY_HOST_CACHE},
    {"kind": "disk", "cache_rows": SMALL_CACHE, "window": 4, "host_cache_rows": TINY_HOST_CACHE},
    {"kind": "disk", "cache_rows": SMALL_CACHE, "window": 4, "host_cache_rows": 0},
    {"kind": "disk", "cache_rows": 400, "window": 8, "host_cache_ratio": 0.05},
    {"kind": "lookahead", "cache_rows": SMALL_CACHE, "window": 2, "overrides": {"b": "disk", "h": "device"},
     "host_cache_rows": TINY_HOST_CACHE},
], ids=["w1", "w4", "no-host-cache", "w8-big", "per-table"])
def test_disk_matches_device_bit_for_bit(reference, placement, tmp_path):
    optimizer, ref = reference
    model, opt = build({**placement, "disk_path": str(tmp_path)}, optimizer=optimizer)
    result = train(BATCHES, model, opt)
    from embedding_harness import dense_state, tables_fp32

    assert_equal((result.losses, tables_fp32(model.embeddings), dense_state(model)), ref)
    stats = model.embeddings.stats()
    assert stats["disk_bytes_read"] > 0  # the disk really served rows
    if placement["kind"] == "disk" and placement.get("host_cache_rows") in (0, TINY_HOST_CACHE):  # rows go back to the file
        assert stats["disk_bytes_written"] > 0 and stats["host_cache_misses"] > len(BATCHES)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_low_precision_on_disk_equals_host(precision, tmp_path):
    """int8/int4 rows on disk behind the fp32 lookahead cache train to the
    bits of the same tables in host memory behind the same cache."""
    cache = {"cache_rows": SMALL_CACHE, "window": 4}
    host = run(BATCHES, {"kind": "lookahead", **cache}, {"kind": precision}, optimizer="adagrad")
    disk = run(BATCHES, {"kind": "disk", **cache, "host_cache_rows": TINY_HOST_CACHE, "disk_path": str(tmp_path)},
               {"kind": precision}, optimizer="adagrad")
    assert_equal(disk, host)
