"""Exact caching: every placement trains to the same losses and weights as `device`."""

import pytest
import torch

from embedding_harness import build, dense_state, make_batches, run, tables_fp32, train
from recsys_cli.embeddings.cache import CacheTooSmall

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)

BATCHES = make_batches(40, batch_size=16)
SMALL_CACHE = 90  # a batch needs up to ~60 unique rows of 477: constant evictions


def assert_equal(result, reference):
    """Bit for bit: every step's loss and every weight (torch.equal)."""
    losses, tables, dense = result
    ref_losses, ref_tables, ref_dense = reference
    assert losses == ref_losses
    for name, ref in [*ref_tables.items(), *ref_dense.items()]:
        got = tables[name] if name in ref_tables else dense[name]
        assert torch.equal(got, ref), name


def assert_close(result, reference, rel=1e-6):
    """Per-step losses within `rel`; every weight within `rel` of itself or of
    its tensor's largest value (a weight near zero has no relative digits to keep)."""
    losses, tables, dense = result
    ref_losses, ref_tables, ref_dense = reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rel, atol=0)
    for name, ref in [*ref_tables.items(), *ref_dense.items()]:
        got = tables[name] if name in ref_tables else dense[name]
        torch.testing.assert_close(got, ref, rtol=rel, atol=rel * float(ref.abs().max()), msg=name)


@pytest.fixture(scope="module", params=["sgd", "adagrad"])
def reference(request):
    return request.param, run(BATCHES, {"kind": "device"}, optimizer=request.param)


@pytest.mark.parametrize(
    "placement",
    [
        {"kind": "host"},
        {"kind": "uvm"},  # the old name of host
        {"kind": "lookahead", "cache_rows": SMALL_CACHE, "window": 1},
        {"kind": "lookahead", "cache_rows": SMALL_CACHE, "window": 4},
        {"kind": "lookahead", "cache_rows": 400, "window": 8},
        {"kind": "cache", "cache_rows": SMALL_CACHE, "policy": "lru"},
        {"kind": "cache", "cache_rows": SMALL_CACHE, "policy": "lfu"},
        {"kind": "lookahead", "cache_rows": SMALL_CACHE, "window": 2, "overrides": {"b": "device", "h": "uvm"}},
        {"kind": "lookahead", "cache_rows": SMALL_CACHE, "device_max_rows": 60},
    ],
    ids=["host", "uvm-alias", "la-w1", "la-w4", "la-w8-big", "cache-lru", "cache-lfu", "mixed", "size-rule"],
)
def test_placement_matches_device(reference, placement):
    optimizer, ref = reference
    # Exact, not merely close: the same arithmetic on the same values.
    assert_equal(run(BATCHES, placement, optimizer=optimizer), ref)


def test_small_cache_really_evicts():
    model, opt = build({"kind": "lookahead", "cache_rows": SMALL_CACHE, "window": 4})
    run(BATCHES, model_opt=(model, opt))
    stats = model.embeddings.stats()
    assert stats["rows_evicted"] > 200
    assert stats["rows_written_back"] > 100
    assert 0 < stats["hit_rate"] < 1


def test_cache_smaller_than_one_batch_is_a_clear_error():
    with pytest.raises(CacheTooSmall, match=r"needs \d+ unique rows .* cache has 20 slots"):
        run(BATCHES, {"kind": "lookahead", "cache_rows": 20, "window": 2})


def test_window_shrinks_instead_of_overflowing():
    # Room for about one batch: the window must shrink rather than fail, and say so.
    model, opt = build({"kind": "lookahead", "cache_rows": 80, "window": 8})
    tight = train(BATCHES, model, opt)
    assert min(tight.window_used) == 0 and max(tight.window_used) <= 8
    assert_equal((tight.losses, tables_fp32(model.embeddings), dense_state(model)), run(BATCHES, {"kind": "device"}))
    # With room for the whole window it never shrinks.
    model, opt = build({"kind": "lookahead", "cache_rows": 477, "window": 8})
    assert train(BATCHES, model, opt).window_used == [8] * len(BATCHES)


def dedup_batches(batches):
    from recsys_cli.data.batch import Batch
    from recsys_cli.data.dedup import dedup_kjt

    return [Batch(b.dense, dedup_kjt(b.sparse), b.labels) for b in batches]


def session_batches(n=20, batch_size=16):
    """Batches whose samples repeat most values (sessions of 4 identical sparse rows)."""
    from recsys_cli.data.batch import Batch
    from recsys_cli.data.jagged import KeyedJaggedTensor

    out = []
    for b in make_batches(n, batch_size=batch_size // 4, seed=11):
        per_key = {k: [bag for bag in bags for _ in range(4)] for k, bags in b.sparse.to_dict().items()}
        out.append(Batch(b.dense.repeat_interleave(4, 0), KeyedJaggedTensor.from_lists(per_key),
                         b.labels.repeat_interleave(4, 0)))
    return out


@pytest.mark.parametrize("placement", [{"kind": "device"}, {"kind": "lookahead", "cache_rows": SMALL_CACHE, "window": 3},
                                       {"kind": "device", "overrides": {"h": "host", "a": "cache"}, "cache_rows": 60}],
                         ids=["device", "lookahead", "mixed"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("data", ["random", "sessions"])
def test_dedup_matches_plain(placement, optimizer, data):
    batches = BATCHES if data == "random" else session_batches()
    plain = run(batches, {"kind": "device"}, optimizer=optimizer)
    dedup = run(dedup_batches(batches), placement, optimizer=optimizer)
    # Duplicates' gradients are summed in another order: equal to 1e-6, not bitwise.
    assert_close(dedup, plain, rel=1e-6)
