"""Initialisation: DLRM's reference draws for the MLPs, TorchRec's for the cross
layers, and table rows that are a function of (seed, table, row) alone."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from recsys_cli.config import PlacementConfig, PrecisionConfig
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.placement import build_embeddings
from recsys_cli.embeddings.quant import make_rows
from recsys_cli.embeddings.table_init import TableSpec, init_rows, init_table
from recsys_cli.model.dlrm import DLRM

FEATURES = ["C1", "C2", "C3", "C4"]
VOCAB = [7, 300, 5000, 40]


def test_rows_do_not_depend_on_chunking():
    spec = TableSpec("C3", 10_007, 16)
    whole = init_table(spec, seed=3)
    gen = torch.Generator().manual_seed(0)
    cuts = sorted(set(torch.randint(0, spec.num_rows, (25,), generator=gen).tolist()) | {0, spec.num_rows})
    pieces = torch.cat([init_rows(spec, a, b, seed=3) for a, b in zip(cuts[:-1], cuts[1:])])
    assert torch.equal(pieces, whole)
    one_by_one = torch.cat([init_rows(spec, r, r + 1, seed=3) for r in range(0, spec.num_rows, 997)])
    assert torch.equal(one_by_one, whole[::997])


def test_rows_are_uniform_within_the_dlrm_bound():
    spec = TableSpec("C9", 40_000, 16)
    w = init_table(spec, seed=0).double()
    bound = 1 / math.sqrt(spec.num_rows)
    n = w.numel()
    assert -bound <= w.min() and w.max() < bound
    assert abs(w.mean().item()) < 4 * bound / math.sqrt(3 * n)
    assert w.var().item() == pytest.approx(bound**2 / 3, rel=0.02)
    # 16 equal bins hold about n / 16 values each (uniform, not just the right variance)
    counts = torch.histc(w, bins=16, min=-bound, max=bound)
    assert (counts - n / 16).abs().max() < 5 * math.sqrt(n / 16)
    # neighbouring rows and columns are uncorrelated
    for a, b in ((w[:-1, 0], w[1:, 0]), (w[:, 0], w[:, 1])):
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 4 / math.sqrt(len(a))


def test_rows_depend_on_seed_and_table_name_only():
    a = init_rows(TableSpec("C1", 100, 8), 0, 50, seed=0)
    assert torch.equal(a, init_rows(TableSpec("C1", 100, 8), 0, 50, seed=0))
    assert not torch.equal(a, init_rows(TableSpec("C1", 100, 8), 0, 50, seed=1))
    assert not torch.equal(a, init_rows(TableSpec("C2", 100, 8), 0, 50, seed=0))
    with pytest.raises(ValueError, match="outside table C1"):
        init_rows(TableSpec("C1", 100, 8), 90, 101, seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_on_cuda_equal_rows_on_cpu():
    spec = TableSpec("C3", 50_000, 128)
    assert torch.equal(init_rows(spec, 100, 40_000, seed=5, device="cuda").cpu(), init_rows(spec, 100, 40_000, seed=5))


def _initial_tables(placement: dict, precision: str = "fp32", optimizer: str = "sgd") -> dict[str, dict]:
    place = OmegaConf.merge(OmegaConf.structured(PlacementConfig), placement)
    prec = OmegaConf.merge(OmegaConf.structured(PrecisionConfig), {"kind": precision})
    emb = build_embeddings(FEATURES, VOCAB, 8, place, prec, RowOptimizer(optimizer), torch.device("cpu"), seed=7)
    return emb.table_state()


def _reference(name: str) -> torch.Tensor:
    """Each table row by row, the other way round from the group's build."""
    spec = TableSpec(name, VOCAB[FEATURES.index(name)], 8)
    return torch.cat([init_rows(spec, r, r + 1, seed=7) for r in range(spec.num_rows)])


@pytest.mark.parametrize("placement", [
    {"kind": "device"}, {"kind": "uvm"}, {"kind": "lookahead", "cache_rows": 600}, {"kind": "cache", "cache_rows": 600},
    {"kind": "lookahead", "cache_rows": 600, "overrides": {"C1": "device", "C4": "uvm"}},
])
def test_initial_tables_are_the_same_in_every_placement(placement):
    tables = _initial_tables(placement, optimizer="adagrad")
    for name in FEATURES:
        assert torch.equal(tables[name]["weights"], _reference(name)), name


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_low_precision_tables_start_from_the_same_fp32_rows(precision):
    """A low-precision table quantizes the same fp32 rows (stochastic
    rounding): every value within one quantization step of them."""
    tables = _initial_tables({"kind": "lookahead", "cache_rows": 600}, precision)
    for name in FEATURES:
        saved, ref = tables[name], _reference(name)
        rows = make_rows(torch.zeros(0, 8), precision)
        for k in rows.tensors():
            setattr(rows, k, saved[k])
        got = rows.read(torch.arange(ref.shape[0]))
        if precision == "fp16":  # one fp16 spacing: 10 mantissa bits, subnormals below 2**-14
            assert ((got - ref).abs() <= ref.abs() * 2**-10 + 2**-24).all(), name
        else:
            step = saved["scale_bias"][:, :1].float()
            assert ((got - ref).abs() <= step * (1 + 1e-3)).all(), name


def _dlrm(init: str, interaction: str = "dot", seed: int = 0) -> DLRM:
    """dlrm_kaggle's MLPs (13-512-256-64-16, 512-256-1) over 26 tables."""
    emb = build_embeddings([f"C{i}" for i in range(1, 27)], [50] * 26, 16, OmegaConf.structured(PlacementConfig),
                           OmegaConf.structured(PrecisionConfig), RowOptimizer(), torch.device("cpu"), seed)
    torch.manual_seed(seed)  # what the trainer does; torch init draws from the global generator
    return DLRM(13, emb, [512, 256, 64, 16], [512, 256, 1], interaction, init, dcn_layers=2, dcn_rank=32, seed=seed)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in list(model.bottom) + list(model.top) if isinstance(m, nn.Linear)]


def _assert_normal(x: torch.Tensor, std: float, what: str) -> None:
    """Mean 0 and standard deviation `std` (root mean square about 0), within 5 standard errors."""
    x = x.detach().double().flatten()
    n = x.numel()
    assert abs(x.mean().item()) < 5 * std / math.sqrt(n), what
    assert abs(x.square().mean().sqrt().item() - std) < 5 * std / math.sqrt(2 * n), what
    if n >= 1000:  # kurtosis: a normal's is 3, a uniform's 1.8
        assert abs((((x - x.mean()) / x.std()) ** 4).mean().item() - 3) < 0.5, what


def test_dlrm_init_draws_the_reference_distributions_per_layer():
    model = _dlrm("dlrm")
    layers = _linears(model)
    assert [tuple(m.weight.shape) for m in layers] == [(512, 13), (256, 512), (64, 256), (16, 64), (512, 367),
                                                       (256, 512), (1, 256)]
    for i, m in enumerate(layers):
        fan_out, fan_in = m.weight.shape
        _assert_normal(m.weight, math.sqrt(2 / (fan_in + fan_out)), f"layer {i} weight")
        _assert_normal(m.bias, math.sqrt(1 / fan_out), f"layer {i} bias")


def test_torch_init_keeps_nn_linear_defaults():
    """init=torch is the old behaviour: U(+-1/sqrt(fan_in)) for weights and biases,
    2.6x DLRM's spread in the first bottom layer."""
    layers = _linears(_dlrm("torch"))
    for m in layers:
        bound = 1 / math.sqrt(m.weight.shape[1])
        for p in (m.weight, m.bias):
            assert p.abs().max() <= bound
        assert m.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1 if m.weight.numel() > 5000 else 0.3)
    first = layers[0].weight.std().item() / math.sqrt(2 / (13 + 512))
    assert 2.3 < first < 2.9


def test_mlp_init_is_a_function_of_the_seed():
    for init in ("dlrm", "torch"):
        a, b, c = _dlrm(init, seed=1), _dlrm(init, seed=1), _dlrm(init, seed=2)
        for (k, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
            assert torch.equal(x, y), (init, k)
        assert not torch.equal(a.bottom[0].weight, c.bottom[0].weight)


@pytest.mark.parametrize("init", ["dlrm", "torch"])
def test_cross_layers_start_as_torchrec_lowrankcrossnet(init):
    model = _dlrm(init, "dcn")
    width = 16 + 26 * 16
    assert len(model.cross.V) == 2
    for v, w in zip(model.cross.V, model.cross.W):
        assert v.weight.shape == (32, width) and w.weight.shape == (width, 32)
        _assert_normal(v.weight, math.sqrt(2 / (width + 32)), "V")
        _assert_normal(w.weight, math.sqrt(2 / (width + 32)), "W")
        assert torch.equal(w.bias, torch.zeros(width))
    assert model.top[0].weight.shape[1] == width
