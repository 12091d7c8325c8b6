"""Deterministic gradient reduction: the segment sum the lookup's backward
uses equals the sequential index_add_ it replaces, bit for bit on CPU, and is
the same from run to run on any device."""

from __future__ import annotations

import pytest
import torch

from recsys_cli.data.jagged import KeyedJaggedTensor
from recsys_cli.embeddings.collection import ExpandBags, SumPool
from recsys_cli.embeddings.plan import SegmentPlan, plan_lookup, segment_sum
from devices import TEST_DEVICE

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)


def _index_add(values: torch.Tensor, target: torch.Tensor, num_targets: int) -> torch.Tensor:
    """The reference: every item added to its target in batch order (CPU, sequential)."""
    out = torch.zeros(num_targets, values.shape[1], dtype=values.dtype)
    return out.index_add_(0, target.cpu(), values.cpu())


def _skewed_ids(n: int, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) ** 3 * rows).long()  # heavy repeats, like real ids


def test_segment_sum_equals_sequential_index_add_including_empty_targets():
    target = _skewed_ids(5000, 700, 1)  # some of the 700 targets get nothing
    values = torch.randn(5000, 16, generator=torch.Generator().manual_seed(2)) * 1e3
    segments = SegmentPlan.of(target, 700)
    assert int((segments.counts == 0).sum()) > 0
    got = segment_sum(values.to(TEST_DEVICE), segments.apply(lambda t: t.to(TEST_DEVICE))).cpu()
    if TEST_DEVICE.type == "cpu":
        assert torch.equal(got, _index_add(values, target, 700))
    else:
        torch.testing.assert_close(got, _index_add(values, target, 700), rtol=1e-5, atol=1e-2)


def _plan(seed: int, dedup: bool):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (2 * 64,), generator=g)
    values = _skewed_ids(int(lengths.sum()), 300, seed)
    ids_per_feature = lengths.view(2, 64).sum(1)
    bag_inverse = torch.randint(0, 64, (2, 96), generator=g) + torch.tensor([[0], [64]]) if dedup else None
    return plan_lookup(values, lengths, ids_per_feature, torch.tensor([0, 300]), bag_inverse)


def _grads(plan, dedup: bool, device: torch.device):
    plan = plan.to(device)
    rows = torch.randn(plan.num_unique, 8, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_()
    pooled = SumPool.apply(rows, plan.inverse, plan.offsets, plan.row_grad)
    if dedup:
        pooled = ExpandBags.apply(pooled, plan.bag_inverse.reshape(-1), plan.bag_grad)
    weight = torch.randn(pooled.shape, generator=torch.Generator().manual_seed(4)).to(device)
    (pooled * weight).sum().backward()
    return rows.grad.cpu(), weight.cpu()


def test_lookup_backward_equals_index_add_reference_and_repeats_exactly():
    for dedup in (False, True):
        plan = _plan(5, dedup)
        grad, weight = _grads(plan, dedup, TEST_DEVICE)
        # The reference: bag gradients (expanded bags summed back in sample order), then ids added to rows.
        bag_grad = _index_add(weight, plan.bag_inverse.reshape(-1), plan.offsets.numel()) if dedup else weight
        ref = _index_add(bag_grad.index_select(0, plan.bag_of_id), plan.inverse, plan.num_unique)
        if TEST_DEVICE.type == "cpu":
            assert torch.equal(grad, ref)
        else:
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(grad, _grads(plan, dedup, TEST_DEVICE)[0]) for _ in range(3))


def test_widened_plan_gives_rows_no_local_id_uses_a_zero_gradient():
    plan = _plan(6, dedup=False)
    local = plan.unique.clone()
    union = torch.unique(torch.cat([local, torch.tensor([1, 299, 450, 599])]), sorted=True)
    expected, _ = _grads(plan, False, torch.device("cpu"))
    plan.widen(union)
    grad, _ = _grads(plan, False, torch.device("cpu"))
    position = torch.searchsorted(union, local)
    assert torch.equal(grad[position], expected)
    others = torch.ones(union.numel(), dtype=torch.bool)
    others[position] = False
    assert int(others.sum()) > 0 and torch.equal(grad[others], torch.zeros(int(others.sum()), 8))


def test_plans_from_kjt_carry_the_sorted_segments():
    kjt = KeyedJaggedTensor.from_lists({"a": [[3, 1, 3], [1], []], "b": [[0], [0, 2], [2]]})
    plan = plan_lookup(kjt.values, kjt.lengths, torch.tensor([4, 4]), torch.tensor([0, 10]))
    # unique rows: 1, 3 (a), 10, 12 (b); the ids of each row listed in batch order.
    assert plan.unique.tolist() == [1, 3, 10, 12]
    assert plan.row_grad.counts.tolist() == [2, 2, 2, 2]
    assert plan.row_grad.source.tolist() == [0, 1, 0, 0, 3, 4, 4, 5]  # bags of the ids, sorted by row


def test_plan_lookup_equals_unique_and_a_stable_sort_by_the_inverse():
    """plan_lookup's single sort gives what torch.unique plus SegmentPlan.of
    gave (the plan every placement's exactness rests on), torch.equal."""
    g = torch.Generator().manual_seed(5)
    for n, vocab in ((0, 5), (1, 5), (300, 7), (3328, 10_000)):
        lengths = torch.randint(0, 3, (max(n // 2, 1),), generator=g)
        lengths[-1] += n - int(lengths.sum()) if int(lengths.sum()) <= n else 0
        values = torch.randint(0, vocab, (int(lengths.sum()),), generator=g)
        per_feature = torch.tensor([values.numel()])
        plan = plan_lookup(values, lengths, per_feature, torch.tensor([3]))
        unique, inverse = torch.unique(values + 3, sorted=True, return_inverse=True)
        assert torch.equal(plan.unique, unique) and torch.equal(plan.inverse, inverse)
        reference = SegmentPlan.of(inverse, unique.numel(), plan.bag_of_id)
        assert torch.equal(plan.row_grad.source, reference.source)
        assert torch.equal(plan.row_grad.counts, reference.counts)
