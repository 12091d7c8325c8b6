"""Low-precision rows: quantization bounds, packing, unbiased rounding, training, checkpoints."""

import pytest
import torch

from embedding_harness import FEATURES, VOCAB, build, make_batches, run
from recsys_cli.embeddings.quant import dequantize_rows, make_rows, quantize_rows, round_to_fp16


def rows(n=500, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g)


@pytest.mark.parametrize("bits", [8, 4])
def test_error_bounds_per_row(bits):
    x = rows()
    for rounding, bound in (("nearest", 0.5), ("stochastic", 1.0)):
        codes, sb = quantize_rows(x, bits, rounding, torch.Generator().manual_seed(1))
        err = (dequantize_rows(codes, sb, bits) - x).abs().max(dim=1).values
        step = sb[:, 0].float()
        # fp32 arithmetic in dequantization adds a few ulps on top of the step bound.
        assert bool((err <= bound * step + 1e-6).all()), rounding
    # Each row's own scale: a row 1000x larger has a 1000x larger step, not everyone's.
    assert sb.shape == (x.shape[0], 2) and sb.dtype == torch.float16


def test_int4_packs_two_values_per_byte_and_round_trips():
    codes = torch.randint(0, 16, (64, 16), dtype=torch.uint8)
    # Rows whose values sit exactly on the code grid come back exactly.
    x = codes.float() * 0.25 - 1.0
    x[:, 0], x[:, 1] = -1.0, 2.75  # pin min and max so scale = 0.25, bias = -1
    packed, sb = quantize_rows(x, 4, "nearest")
    assert packed.shape == (64, 8) and packed.dtype == torch.uint8
    assert torch.equal(dequantize_rows(packed, sb, 4), x)
    low, high = packed & 0x0F, packed >> 4
    expected = torch.round((x + 1.0) / 0.25).to(torch.uint8)
    assert torch.equal(low, expected[:, 0::2]) and torch.equal(high, expected[:, 1::2])


def test_constant_row_is_exact():
    x = torch.full((3, 8), 0.125)
    for bits in (8, 4):
        codes, sb = quantize_rows(x, bits, "stochastic")
        assert torch.equal(dequantize_rows(codes, sb, bits), x)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    x = rows(4, 16, seed=3)
    trials = 4000
    g = torch.Generator().manual_seed(7)
    reps = x.repeat(trials, 1)
    codes, sb = quantize_rows(reps, bits, "stochastic", g)
    mean = dequantize_rows(codes, sb, bits).view(trials, 4, 16).mean(0)
    step = sb[:4, 0].float().unsqueeze(1)
    # Rounding error is within one step, so its mean over n trials has std <= step/(2 sqrt n).
    assert bool(((mean - x).abs() <= 5 * step / (2 * trials**0.5)).all())
    codes, sb = quantize_rows(reps, bits, "nearest")
    biased = (dequantize_rows(codes, sb, bits).view(trials, 4, 16).mean(0) - x).abs().max()
    assert biased > 10 * (mean - x).abs().max()  # nearest is deterministic, hence biased


def test_fp16_stochastic_rounding_is_unbiased():
    x = torch.full((200_000,), 0.1234567)
    r = round_to_fp16(x, "stochastic", torch.Generator().manual_seed(0)).float()
    assert abs(r.mean().item() - 0.1234567) < 2e-7
    assert abs(x.half().float()[0].item() - 0.1234567) > 1e-5


def test_small_updates_survive_only_stochastic_rounding():
    base = rows(1, 16, seed=5)
    delta = 0.02 * (base.amax() - base.amin()) / 255  # far below half an int8 step
    results = {}
    for rounding in ("nearest", "stochastic"):
        store = make_rows(base.clone(), "int8", rounding, torch.Generator().manual_seed(0))
        ids = torch.tensor([0])
        start = store.read(ids).clone()
        for _ in range(500):
            store.write(ids, store.read(ids) + delta)
        results[rounding] = (store.read(ids) - start).mean().item()
    assert results["nearest"] == 0.0  # every update rounded away
    assert results["stochastic"] == pytest.approx(500 * delta.item(), rel=0.35)


BATCHES = make_batches(25, batch_size=16)


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("placement", ["device", "uvm", "lookahead", "cache"])
def test_every_placement_and_precision_trains(placement, precision):
    place = {"kind": placement, "cache_rows": 120}
    prec = {"kind": precision, "cache_ratio": 0.3, "policy": "lfu" if placement == "uvm" else "lru"}
    losses, tables, _ = run(BATCHES, place, prec)
    assert all(torch.isfinite(torch.tensor(losses)))
    fp32_losses, fp32_tables, _ = run(BATCHES, place)
    # Low precision changes the trajectory a little, not the picture.
    assert abs(sum(losses) - sum(fp32_losses)) / sum(fp32_losses) < 0.05
    tolerance = 0.15 if precision == "int4" else 0.05  # int4 steps are ~1/16 of a row's range
    for name in FEATURES:
        assert (tables[name] - fp32_tables[name]).abs().max() < tolerance


def test_lfu_admission_keeps_some_rows_in_low_precision():
    model, opt = build({"kind": "device"}, {"kind": "int8", "cache_ratio": 0.1, "policy": "lfu"})
    run(BATCHES, model_opt=(model, opt))
    stats = model.embeddings.stats()
    assert stats["not_admitted"] > 0 and stats["hits"] > 0


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_quantized_tables_checkpoint_bit_exact(precision):
    model, opt = build({"kind": "cache", "cache_rows": 120}, {"kind": precision, "cache_ratio": 0.3})
    run(BATCHES[:10], model_opt=(model, opt))
    saved = model.embeddings.table_state()
    other, _ = build({"kind": "lookahead", "cache_rows": 200}, {"kind": precision})
    other.embeddings.load_table_state(saved)
    again = other.embeddings.table_state()
    for name, tensors in saved.items():
        for key, value in tensors.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, again[name][key]), (name, key)


@pytest.mark.parametrize("precision, row_bytes", [("fp32", 32), ("fp16", 16), ("int8", 8 + 4), ("int4", 4 + 4)])
def test_memory_is_measured_from_allocated_tensors(precision, row_bytes):
    model, _ = build({"kind": "uvm"}, {"kind": precision, "cache_ratio": 0.05})
    mem = model.embeddings.memory()
    rows = sum(VOCAB)
    # dim 8: codes (8, 4 or 2 x 8 bytes) plus an fp16 scale and bias per row.
    assert mem["table"] == rows * row_bytes
    if precision == "fp32":
        assert mem["cache"] == 0 and mem["device"] == 0
    else:
        assert mem["cache"] == round(rows * 0.05) * 8 * 4  # fp32 cache slots, on the device
        assert mem["device"] == mem["cache"] and mem["host"] == mem["table"] + mem["index"]
