"""SlotIndex (the cache's row -> slot hash map) against a dict reference."""

from __future__ import annotations

import random

import pytest
import torch

from recsys_cli.embeddings.slot_index import INT32_KEYS_BELOW, MAX_FILL, SlotIndex, index_bytes
from devices import TEST_DEVICE


def _check(index: SlotIndex, ref: dict[int, int], universe: int) -> None:
    probe = torch.arange(universe, dtype=torch.int64)
    want = torch.tensor([ref.get(k, -1) for k in range(universe)], dtype=torch.int64)
    assert torch.equal(index.lookup(probe.to(index.device)).cpu(), want)
    assert len(index) == len(ref)
    keys, values = index.items()
    got = dict(zip(keys.cpu().tolist(), values.cpu().tolist()))
    assert got == ref


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_insert_remove_lookup_equals_a_dict(seed):
    """Batches of inserts and removes, as a cache makes them, with keys from a
    universe much larger than the index (fused row ids of a big table)."""
    rng = random.Random(seed)
    capacity, universe = 200, 5000
    index = SlotIndex(capacity, TEST_DEVICE)
    ref: dict[int, int] = {}
    for _ in range(150):
        if ref and rng.random() < 0.45:
            gone = rng.sample(sorted(ref), rng.randint(1, len(ref)))
            absent = [k for k in rng.sample(range(universe), 5) if k not in ref]
            if rng.random() < 0.5:  # absent and repeated keys
                removed = index.remove(torch.tensor(gone + absent + gone[:3], device=TEST_DEVICE))
            else:  # a cache's victims: each key once
                removed = index.remove(torch.tensor(gone + absent, device=TEST_DEVICE), distinct=True)
            assert removed == len(gone)
            for k in gone:
                del ref[k]
        else:
            room = capacity - len(ref)
            fresh = [k for k in rng.sample(range(universe), min(universe, room + 20)) if k not in ref][: rng.randint(0, room)]
            values = [rng.randrange(capacity) for _ in fresh]
            index.insert(torch.tensor(fresh, dtype=torch.int64, device=TEST_DEVICE), torch.tensor(values, device=TEST_DEVICE))
            ref.update(zip(fresh, values))
        queried = torch.tensor([rng.randrange(universe) for _ in range(64)], dtype=torch.int64)
        want = torch.tensor([ref.get(k, -1) for k in queried.tolist()], dtype=torch.int64)
        assert torch.equal(index.lookup(queried.to(TEST_DEVICE)).cpu(), want)
    _check(index, ref, universe)


def test_colliding_keys_in_one_batch():
    """Keys that all hash to one home bucket, inserted together and removed
    from the middle of their probe chain: later keys of the chain stay found."""
    index = SlotIndex(64, TEST_DEVICE)
    homes = index._home(torch.arange(100_000, device=TEST_DEVICE)).cpu()
    same = torch.nonzero(homes == homes[0]).flatten()[:12]
    assert same.numel() == 12
    index.insert(same.to(TEST_DEVICE), torch.arange(12, device=TEST_DEVICE))
    ref = dict(zip(same.tolist(), range(12)))
    _check(index, ref, 100_000)
    middle = same[3:7]
    index.remove(middle.to(TEST_DEVICE))
    for k in middle.tolist():
        del ref[k]
    _check(index, ref, 100_000)
    index.insert(middle[:2].to(TEST_DEVICE), torch.tensor([40, 41], device=TEST_DEVICE))  # reuses tombstones
    ref.update({middle[0].item(): 40, middle[1].item(): 41})
    _check(index, ref, 100_000)


def test_full_index_and_churn():
    """Filled to capacity it still answers; one key more is refused; heavy
    churn (tombstones) triggers rebuilds without losing an entry."""
    capacity = 100
    index = SlotIndex(capacity, TEST_DEVICE)
    keys = torch.arange(0, 10 * capacity, 10, dtype=torch.int64)
    index.insert(keys.to(TEST_DEVICE), torch.arange(capacity, device=TEST_DEVICE))
    ref = dict(zip(keys.tolist(), range(capacity)))
    _check(index, ref, 10 * capacity)
    with pytest.raises(ValueError, match="full"):
        index.insert(torch.tensor([7], device=TEST_DEVICE), torch.tensor([0], device=TEST_DEVICE))
    rng = random.Random(5)
    next_key = 10 * capacity
    for _ in range(300):  # replace a few entries at a time: tombstones pile up until a rebuild
        gone = rng.sample(sorted(ref), 7)
        index.remove(torch.tensor(gone, device=TEST_DEVICE))
        fresh = list(range(next_key, next_key + 7))
        next_key += 7
        values = [ref.pop(k) for k in gone]
        index.insert(torch.tensor(fresh, device=TEST_DEVICE), torch.tensor(values, device=TEST_DEVICE))
        ref.update(zip(fresh, values))
        assert index.size + index.tombstones <= MAX_FILL * index.num_buckets
    _check(index, ref, next_key)


def test_large_keys_and_memory_sized_to_capacity():
    """Keys past 2**32 (fused rows of huge tables) are distinct keys, and the
    index's bytes depend on its capacity, never on the key range."""
    index = SlotIndex(1000, TEST_DEVICE)
    keys = torch.tensor([5, 5 + (1 << 32), 5 + (1 << 40), (1 << 62) + 5], dtype=torch.int64)
    index.insert(keys.to(TEST_DEVICE), torch.arange(4, device=TEST_DEVICE))
    assert index.lookup(keys.to(TEST_DEVICE)).cpu().tolist() == [0, 1, 2, 3]
    assert index.lookup(torch.tensor([6], device=TEST_DEVICE)).cpu().tolist() == [-1]
    assert index.nbytes() == SlotIndex(1000).nbytes() == 2000 * (8 + 4) == index_bytes(1000)  # int64 keys
    assert index.lookup(torch.zeros(0, dtype=torch.int64, device=TEST_DEVICE)).numel() == 0


def _keys_with_home(index: SlotIndex, home: int, count: int) -> torch.Tensor:
    homes = index._home(torch.arange(2_000_000, device=index.device)).cpu()
    keys = torch.nonzero(homes == home).flatten()[:count]
    assert keys.numel() == count
    return keys


def test_a_contested_bucket_goes_to_the_lowest_batch_position():
    """Keys sharing a home bucket, inserted in one batch, take the buckets
    from their home on in batch order, whatever order their values have: the
    layout is a function of the batch, not of how the rounds ran."""
    index = SlotIndex(64, TEST_DEVICE)
    same = _keys_with_home(index, 100, 10)[torch.tensor([3, 0, 9, 1, 7, 2, 8, 4, 6, 5])]  # not sorted by key
    index.insert(same.to(TEST_DEVICE), torch.arange(10, device=TEST_DEVICE))
    assert torch.equal(index.keys[100:110].cpu(), same)
    assert torch.equal(index.values[100:110].cpu(), torch.arange(10, dtype=torch.int32))
    again = SlotIndex(64, TEST_DEVICE)
    again.insert(same.to(TEST_DEVICE), torch.arange(10, device=TEST_DEVICE))
    assert torch.equal(again.keys, index.keys) and torch.equal(again.values, index.values)


def test_probe_chains_that_wrap_past_the_last_bucket():
    """Keys homed at the last bucket, with a chain longer than a probe round's
    window, wrap to bucket 0 and on; lookups and removes follow them, and a
    key homed at bucket 0 probes past the wrapped ones."""
    index = SlotIndex(16, TEST_DEVICE)
    last = index.num_buckets - 1
    tail = _keys_with_home(index, last, 12)
    index.insert(tail.to(TEST_DEVICE), torch.arange(12, device=TEST_DEVICE))
    assert index.keys[last].item() == tail[0].item()
    assert torch.equal(index.keys[:11].cpu(), tail[1:])
    head = _keys_with_home(index, 0, 3)
    index.insert(head.to(TEST_DEVICE), torch.tensor([20, 21, 22], device=TEST_DEVICE))
    ref = {**dict(zip(tail.tolist(), range(12))), **dict(zip(head.tolist(), [20, 21, 22]))}
    _check(index, ref, 2_000_000)
    assert index.remove(tail[2:9].to(TEST_DEVICE)) == 7
    for k in tail[2:9].tolist():
        del ref[k]
    _check(index, ref, 2_000_000)


@pytest.mark.parametrize("seed", [0, 1])
def test_int32_keys_equal_a_dict_and_cost_16_bytes_a_slot(seed):
    """Keys of a table below 2**31 rows are held as int32 (issue 27: the index
    cost 85 bytes a slot at Kaggle's 5 % cache): the same answers as a dict,
    keys up to the bound included, in 2 buckets of 8 bytes per slot."""
    rng = random.Random(seed)
    capacity, top = 300, INT32_KEYS_BELOW - 1
    index = SlotIndex(capacity, TEST_DEVICE, max_key=top)
    assert index.keys.dtype == torch.int32 and index.nbytes() == capacity * 16 == index_bytes(capacity, top)
    universe = [top, top - 1, 0, 1] + rng.sample(range(top), 2000)
    ref: dict[int, int] = {}
    for _ in range(80):
        if ref and rng.random() < 0.45:
            gone = rng.sample(sorted(ref), rng.randint(1, len(ref)))
            assert index.remove(torch.tensor(gone, device=TEST_DEVICE)) == len(gone)
            for k in gone:
                del ref[k]
        else:
            fresh = [k for k in rng.sample(universe, 60) if k not in ref][: capacity - len(ref)]
            values = [rng.randrange(capacity) for _ in fresh]
            index.insert(torch.tensor(fresh, dtype=torch.int64, device=TEST_DEVICE),
                         torch.tensor(values, device=TEST_DEVICE))
            ref.update(zip(fresh, values))
        queried = torch.tensor(rng.sample(universe, 100) + [top + 1, 1 << 40], dtype=torch.int64)  # and keys past it
        want = torch.tensor([ref.get(k, -1) for k in queried.tolist()], dtype=torch.int64)
        assert torch.equal(index.lookup(queried.to(TEST_DEVICE)).cpu(), want)
    keys, values = index.items()
    assert keys.dtype == torch.int64 and dict(zip(keys.cpu().tolist(), values.cpu().tolist())) == ref
    with pytest.raises(ValueError, match="above the index's max_key"):
        SlotIndex(4, TEST_DEVICE, max_key=10).insert(torch.tensor([11], device=TEST_DEVICE),
                                                     torch.tensor([0], device=TEST_DEVICE))
    assert SlotIndex(4, max_key=INT32_KEYS_BELOW).keys.dtype == torch.int64  # past the bound: int64 keys


def test_an_int32_index_never_finds_a_key_beyond_its_range_by_its_low_bits():
    """Queries are compared in the index's key dtype; a key above int32's range
    is not cut to its low 32 bits, which may be a key the index holds."""
    index = SlotIndex(50, TEST_DEVICE, max_key=1000)
    held = torch.tensor([5, 7, 999], device=TEST_DEVICE)
    index.insert(held, torch.tensor([0, 1, 2], device=TEST_DEVICE))
    aliases = held + (1 << 32)  # the same low 32 bits
    assert index.lookup(aliases).tolist() == [-1, -1, -1]
    assert index.remove(aliases) == 0 and index.lookup(held).tolist() == [0, 1, 2]


def test_an_index_smaller_than_a_probe_window_wraps_every_probe():
    index = SlotIndex(3, TEST_DEVICE)  # 6 buckets: every window of 8 runs past the last
    index.insert(torch.tensor([11, 4, 29], device=TEST_DEVICE), torch.tensor([0, 1, 2], device=TEST_DEVICE))
    _check(index, {11: 0, 4: 1, 29: 2}, 40)
    assert index.remove(torch.tensor([4, 5], device=TEST_DEVICE)) == 1
    index.insert(torch.tensor([5], device=TEST_DEVICE), torch.tensor([1], device=TEST_DEVICE))
    _check(index, {11: 0, 5: 1, 29: 2}, 40)


def test_a_long_probe_chain_is_crossed_in_a_few_widening_rounds():
    """A chain of 300 keys homed at the last buckets wraps past bucket 0; every
    key is still found, inserted and removed as a dict says, and a lookup
    crosses the chain in 4 window rounds (8, 32, 128 and 512 buckets a key),
    not the 37 rounds of 8 buckets it took before the windows widened: a
    round's cost is its torch ops, whatever its size."""
    index = SlotIndex(1000, TEST_DEVICE)  # 2000 buckets
    candidates = torch.arange(200_000)
    homes = index._home(candidates.to(index.device)).cpu()
    chain = candidates[homes >= index.num_buckets - 4][:300]
    absent = candidates[homes < index.num_buckets - 4][:300]  # keys whose probes run into the chain or stop short
    assert chain.numel() == 300
    index.insert(chain.to(TEST_DEVICE), torch.arange(300, device=TEST_DEVICE))
    widths = []
    window = index._window

    def counted(pos, width):
        widths.append(width)
        return window(pos, width)

    index._window = counted
    last = chain[-1:].to(TEST_DEVICE)  # the key at the chain's end
    assert index.lookup(last).tolist() == [299]
    assert widths == [8, 32, 128, 512]

    def check(ref: dict[int, int]) -> None:
        probe = torch.cat([chain, absent])
        want = torch.tensor([ref.get(k, -1) for k in probe.tolist()])
        assert torch.equal(index.lookup(probe.to(TEST_DEVICE)).cpu(), want)
        keys, values = index.items()
        assert dict(zip(keys.cpu().tolist(), values.cpu().tolist())) == ref

    ref = dict(zip(chain.tolist(), range(300)))
    check(ref)
    assert index.remove(chain[100:250].to(TEST_DEVICE), distinct=True) == 150
    for k in chain[100:250].tolist():
        del ref[k]
    check(ref)
