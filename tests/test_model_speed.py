"""The dense model's fast paths compute what the obvious code computes, bit for bit.

The references here are written the way the model was before: nn.Linear
layers, and the dot interaction's lower triangle picked with advanced
indexing (z[:, rows, cols]).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recsys_cli.model.dlrm import DLRM
from recsys_cli.model.linear import Linear, transposed_backward


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def compute_threads(request):
    """One thread takes the transposed backward, more take nn.Linear's (linear.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("batch", [1, 7, 12, 16, 100, 128, 2048])
@pytest.mark.parametrize("shape", [(13, 512), (367, 512), (512, 256), (100, 37)])
def test_linear_matches_nn_linear_forward_and_backward(batch, shape, compute_threads):
    n_in, n_out = shape
    torch.manual_seed(batch)
    ours = Linear(n_in, n_out)
    ref = nn.Linear(n_in, n_out)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(batch, n_in)
    g = torch.randn(batch, n_out)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), ref(x2)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(y1, y2)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(ours.weight.grad, ref.weight.grad)
    assert torch.equal(ours.bias.grad, ref.bias.grad)
    assert ours.weight.grad.is_contiguous()  # the optimizer's layout


def test_transposed_backward_only_for_unaligned_inputs():
    assert transposed_backward(13, 512) and transposed_backward(367, 512)
    assert not transposed_backward(512, 256) and not transposed_backward(256, 1) and not transposed_backward(100, 37)


def _reference_dense(model: DLRM) -> nn.Module:
    """The model's dense half written the obvious way: nn.Linear, advanced indexing."""

    class Ref(nn.Module):
        def __init__(self):
            super().__init__()
            self.bottom = nn.Sequential(*[nn.Linear(m.in_features, m.out_features) if isinstance(m, nn.Linear)
                                          else nn.ReLU() for m in model.bottom])
            self.top = nn.Sequential(*[nn.Linear(m.in_features, m.out_features) if isinstance(m, nn.Linear)
                                       else nn.ReLU() for m in model.top])
            n = len(model.embeddings.features) + 1
            self.rows, self.cols = torch.tril_indices(n, n, offset=-1)

        def forward(self, dense, pooled):
            bottom = self.bottom(dense)
            t = torch.cat([bottom.unsqueeze(1), pooled], dim=1)
            z = torch.bmm(t, t.transpose(1, 2))
            return self.top(torch.cat([bottom, z[:, self.rows, self.cols]], dim=1)).squeeze(1)

    ref = Ref()
    ref.load_state_dict({k: v for k, v in model.state_dict().items()})
    return ref


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_dlrm_kaggle_dense_steps_equal_the_obvious_code(optimizer):
    """Ten steps of dlrm_kaggle's MLPs and dot interaction (13 -> 512 -> ... ->
    16, 367 -> 512 -> 256 -> 1): losses, pooled-embedding gradients and
    weights equal the reference's bit for bit."""
    emb = SimpleNamespace(features=[f"C{i}" for i in range(26)], dim=16)
    model = DLRM(13, emb, [512, 256, 64, 16], [512, 256, 1], "dot", "dlrm", seed=3)
    ref = _reference_dense(copy.deepcopy(model))
    make = (lambda p: torch.optim.SGD(p, lr=0.1)) if optimizer == "sgd" else (lambda p: torch.optim.Adagrad(p, lr=0.05))
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    g = torch.Generator().manual_seed(0)
    for step in range(10):
        batch = 64 + step
        dense = torch.randn(batch, 13, generator=g)
        pooled = torch.randn(batch, 26, 16, generator=g) * 0.1
        labels = (torch.rand(batch, generator=g) < 0.25).float()
        p1, p2 = pooled.clone().requires_grad_(), pooled.clone().requires_grad_()
        loss1 = F.binary_cross_entropy_with_logits(model.dense_forward(dense, p1), labels)
        loss2 = F.binary_cross_entropy_with_logits(ref(dense, p2), labels)
        for o, loss in ((opt, loss1), (ref_opt, loss2)):
            o.zero_grad(set_to_none=True)
            loss.backward()
            o.step()
        assert torch.equal(loss1, loss2)
        assert torch.equal(p1.grad, p2.grad)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_foreach_dense_optimizers_equal_the_loop(optimizer):
    """The trainer's dense optimizers run foreach (one multi-tensor kernel per
    update); the reference trainer's run torch's per-parameter loop."""
    emb = SimpleNamespace(features=[f"C{i}" for i in range(4)], dim=8)
    model = DLRM(13, emb, [32, 8], [32, 1], "dot", "dlrm", seed=1)
    ref = copy.deepcopy(model)
    if optimizer == "sgd":
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True), torch.optim.SGD(ref.parameters(), lr=0.1)
    else:
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05, foreach=True)
        ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        dense, pooled = torch.randn(32, 13, generator=g), torch.randn(32, 4, 8, generator=g)
        labels = (torch.rand(32, generator=g) < 0.3).float()
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = F.binary_cross_entropy_with_logits(m.dense_forward(dense, pooled), labels)
            o.zero_grad(set_to_none=True)
            loss.backward()
            o.step()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


def _small(**kwargs) -> DLRM:
    emb = SimpleNamespace(features=[f"C{i}" for i in range(4)], dim=8)
    return DLRM(13, emb, [32, 8], [32, 1], "dot", "dlrm", seed=2, **kwargs)


def _grads(model: DLRM, dense, pooled, labels):
    pooled = pooled.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    loss = F.binary_cross_entropy_with_logits(model.dense_forward(dense, pooled), labels)
    loss.backward()
    return loss.detach(), pooled.grad, [p.grad for p in model.parameters()]


def test_bf16_mlps_stay_close_to_fp32_and_return_fp32_logits():
    fp32, bf16 = _small(), _small(dense_precision="bf16")
    g = torch.Generator().manual_seed(0)
    dense, pooled = torch.randn(64, 13, generator=g), torch.randn(64, 4, 8, generator=g)
    labels = (torch.rand(64, generator=g) < 0.3).float()
    assert bf16.dense_forward(dense, pooled).dtype == torch.float32
    loss32, pooled32, grads32 = _grads(fp32, dense, pooled, labels)
    loss16, pooled16, grads16 = _grads(bf16, dense, pooled, labels)
    assert not torch.equal(loss32, loss16)  # the MLPs really ran in bf16
    assert abs(loss32 - loss16) < 2e-2
    assert torch.allclose(pooled16, pooled32, rtol=0.1, atol=1e-3)
    assert all(b.dtype == torch.float32 for b in grads16)  # parameters stay fp32 (autocast)
    with pytest.raises(ValueError, match="dense_precision"):
        _small(dense_precision="fp8")


def test_compiled_dense_step_matches_eager_closely():
    eager, compiled = _small(), _small(compile=True)
    g = torch.Generator().manual_seed(0)
    dense, pooled = torch.randn(64, 13, generator=g), torch.randn(64, 4, 8, generator=g)
    labels = (torch.rand(64, generator=g) < 0.3).float()
    loss_e, pooled_e, grads_e = _grads(eager, dense, pooled, labels)
    loss_c, pooled_c, grads_c = _grads(compiled, dense, pooled, labels)
    assert compiled._compiled is not None  # the training step took the compiled path
    assert torch.allclose(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert torch.allclose(pooled_c, pooled_e, rtol=1e-4, atol=1e-6)
    for a, b in zip(grads_c, grads_e):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # evaluation stays eager
        assert torch.equal(compiled.dense_forward(dense, pooled), eager.dense_forward(dense, pooled))
