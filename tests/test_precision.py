"""Low-precision rows: quantization bounds, packing, unbiased counter-based rounding, training, checkpoints."""

import pytest
import torch

from embedding_harness import VOCAB, build, make_batches, run
from recsys_cli.embeddings.quant import (RoundingKey, counter_hash, dequantize_rows, make_rows, quantize_rows,
                                         round_to_fp16, uniform_noise)
from train_config import config

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)


def rows(n=500, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g)


def noise(n, d, seed=1, step=0):
    """Counter-based uniform noise for n rows of one table at one step."""
    return uniform_noise(counter_hash(seed, torch.zeros(n, dtype=torch.int64), torch.arange(n), step, d))


@pytest.mark.parametrize("bits", [8, 4])
def test_error_bounds_per_row(bits):
    x = rows()
    for rounding, bound in (("nearest", 0.5), ("stochastic", 1.0)):
        codes, sb = quantize_rows(x, bits, rounding, noise(*x.shape))
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
    reps = x.repeat(trials, 1)
    codes, sb = quantize_rows(reps, bits, "stochastic", noise(*reps.shape, seed=7))
    mean = dequantize_rows(codes, sb, bits).view(trials, 4, 16).mean(0)
    step = sb[:4, 0].float().unsqueeze(1)
    # Rounding error is within one step, so its mean over n trials has std <= step/(2 sqrt n).
    assert bool(((mean - x).abs() <= 5 * step / (2 * trials**0.5)).all())
    codes, sb = quantize_rows(reps, bits, "nearest")
    biased = (dequantize_rows(codes, sb, bits).view(trials, 4, 16).mean(0) - x).abs().max()
    assert biased > 10 * (mean - x).abs().max()  # nearest is deterministic, hence biased


def test_fp16_stochastic_rounding_is_unbiased():
    x = torch.full((200_000, 1), 0.1234567)
    hashes = counter_hash(0, torch.zeros(200_000, dtype=torch.int64), torch.arange(200_000), 3, 1)
    r = round_to_fp16(x, "stochastic", hashes).float()
    assert abs(r.mean().item() - 0.1234567) < 2e-7
    assert abs(x.half().float()[0].item() - 0.1234567) > 1e-5


def test_small_updates_survive_only_stochastic_rounding():
    base = rows(1, 16, seed=5)
    delta = 0.02 * (base.amax() - base.amin()) / 255  # far below half an int8 step
    results = {}
    for rounding in ("nearest", "stochastic"):
        ids = torch.tensor([0])
        key = lambda step: RoundingKey(0, torch.tensor([0]), ids, step)  # noqa: E731
        store = make_rows(base.clone(), "int8", rounding, key(-1))
        start = store.read(ids).clone()
        for step in range(500):
            store.write(ids, store.read(ids) + delta, key(step))
        results[rounding] = (store.read(ids) - start).mean().item()
    assert results["nearest"] == 0.0  # every update rounded away
    assert results["stochastic"] == pytest.approx(500 * delta.item(), rel=0.35)


def test_counter_noise_is_keyed_not_sequential():
    """The noise of a row's write depends on (seed, table, row, step, column)
    only: not on which other rows are written with it, nor in which order."""
    table, row = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([3, 4, 3, 4, 3])
    together = counter_hash(9, table, row, 17, 8)
    order = torch.tensor([4, 2, 0, 3, 1])
    assert torch.equal(counter_hash(9, table[order], row[order], 17, 8), together[order])
    assert torch.equal(counter_hash(9, table[2:3], row[2:3], 17, 8), together[2:3])
    # Every key part matters, and the columns differ.
    for other in (counter_hash(8, table, row, 17, 8), counter_hash(9, table, row, 18, 8), together[[1, 2, 3, 4, 0]]):
        assert not bool((other == together).any())
    assert together[0].unique().numel() == 8
    # Uniform in [0, 1): mean and spread of a uniform.
    u = uniform_noise(counter_hash(1, torch.zeros(50_000, dtype=torch.int64), torch.arange(50_000), 0, 4))
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002


def test_int32_counter_hash_equals_the_int64_arithmetic():
    """counter_hash runs its per-element rounds in int32 (counter.fmix32_int32_):
    the same bits as the int64 arithmetic it replaced, computed here the old
    way, for 64-bit seeds and rows, negative steps, odd widths."""
    from recsys_cli.embeddings.counter import MASK32, fmix32

    g = torch.Generator().manual_seed(5)
    table = torch.randint(0, 40, (3000,), generator=g)
    row = torch.randint(0, 1 << 40, (3000,), generator=g)
    for seed, step, width in ((0, 0, 16), (2**33 + 7, -1, 127), (12345, torch.randint(-2, 1 << 20, (3000,), generator=g), 8)):
        steps = torch.as_tensor(step, dtype=torch.int64).expand(row.shape)
        h = torch.full(row.shape, seed & MASK32, dtype=torch.int64)
        for word in (table & MASK32, row & MASK32, row >> 32, steps & MASK32):
            h = fmix32(h ^ word ^ 0x9E3779B9)
        reference = fmix32(fmix32(h.unsqueeze(1) ^ torch.arange(width)))
        assert torch.equal(counter_hash(seed, table, row, step, width), reference)
        bits = RoundingKey(seed, table, row, step).hashes(width)
        assert bits.dtype == torch.int32 and torch.equal(bits.to(torch.int64) & MASK32, reference)
        assert torch.equal(uniform_noise(bits), uniform_noise(reference))
    # A row wider than 2**16 columns: fmix32's first step is not folded per row there.
    steps = torch.tensor([3, -1])
    h = torch.full((2,), 7, dtype=torch.int64)
    for word in (table[:2] & MASK32, row[:2] & MASK32, row[:2] >> 32, steps & MASK32):
        h = fmix32(h ^ word ^ 0x9E3779B9)
    assert torch.equal(counter_hash(7, table[:2], row[:2], steps, 70_000),
                       fmix32(fmix32(h.unsqueeze(1) ^ torch.arange(70_000))))


# sha256 (first 32 hex digits) of the tables below as built before the
# int32 hashing (commit 5a160a0): the build's bits did not change.
BUILT_BEFORE = {"int4": "6e77da750652a78c7c0de125d098fa28", "int8": "c11d7a3af5f9aa8f651e3b7f4198e386",
                "fp16": "4dc9f6c5653d32d7a71b726c22e3d91e"}


@pytest.mark.parametrize("precision", sorted(BUILT_BEFORE))
def test_a_built_low_precision_table_has_the_bits_it_had(precision):
    import hashlib

    from recsys_cli.embeddings.store import RowStore
    from recsys_cli.embeddings.table_init import TableSpec, build_initial_rows

    seed = 2**33 + 7
    specs = [TableSpec("C1", 5000, 16), TableSpec("C7", 3000, 16, first_row=1000, table_num_rows=9000)]
    store = RowStore(8000, 16, torch.zeros(8000, 1), precision=precision, seed=seed,
                     table_rows=[(0, 5000), (6, 3000, 1000)])
    build_initial_rows(specs, seed, store.write_initial, chunk_rows=777, into=store.initial_view, workers=2)
    digest = hashlib.sha256()
    for tensor in store.rows.tensors().values():
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    assert digest.hexdigest()[:32] == BUILT_BEFORE[precision]


# sha256 (first 32 hex digits) of dim-128 tables (MLPerf DLRM-DCNv2's dim) as
# built at f6ca939, before the build drew each init block's stream once, in
# fp32, and the CPU's hashes, row extremes and int4 packing changed: in host
# memory and in a disk store's file (codes, scale/bias and state records).
BUILT_AT_DIM_128 = {
    ("host", "int4"): "3fc79d40f301e626cefa787cbc8087ca", ("disk", "int4"): "ed118edec6778941e332bdd1ffe9af88",
    ("host", "int8"): "5ded92b6c11807c4f9f0d9b2fc4a096a", ("disk", "int8"): "0baa193bde4de847df4e97e61492fedc",
    ("host", "fp16"): "527cb2704bee8cfcf04f889ce5220d69", ("disk", "fp16"): "694ac78137056bea6ecc56acd0db063b",
}


@pytest.mark.parametrize("where,precision", sorted(BUILT_AT_DIM_128))
def test_a_dim_128_table_has_the_bits_it_had(tmp_path, where, precision):
    import hashlib

    import numpy as np

    from recsys_cli.embeddings.disk_store import DiskRowStore
    from recsys_cli.embeddings.store import RowStore
    from recsys_cli.embeddings.table_init import TableSpec, build_initial_rows

    seed = 2**33 + 7
    # the shard starts mid-block (row 1000 of its table): its first block's stream is drawn from the block's start
    specs = [TableSpec("C1", 9001, 128), TableSpec("C7", 5000, 128, first_row=1000, table_num_rows=90000)]
    digest = hashlib.sha256()
    if where == "host":
        store = RowStore(14001, 128, torch.zeros(14001, 1), precision=precision, seed=seed,
                         table_rows=[(0, 9001), (6, 5000, 1000)])
        build_initial_rows(specs, seed, store.write_initial, into=store.initial_view, workers=2)
        for tensor in store.rows.tensors().values():
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    else:
        disk = DiskRowStore(specs, [0, 6], precision, "stochastic", seed, 1, 0.25, str(tmp_path), host_cache_rows=0)
        try:
            digest.update(np.fromfile(disk.path, dtype=np.uint8).tobytes())
        finally:
            disk.close()
    assert digest.hexdigest()[:32] == BUILT_AT_DIM_128[where, precision]


def _quantize_as_before(rows, bits, rounding, noise):
    """quantize_rows as it was at f6ca939: amin/amax reductions, out-of-place
    ops, uint8 codes packed with shifts (its grid, unchanged, is quant's)."""
    from recsys_cli.embeddings.quant import _grid

    levels = (1 << bits) - 1
    lo, hi = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
    scale, bias = _grid(lo, hi, levels, rounding)  # unchanged: the same fp16 grid from the same extremes
    scale_f = scale.float()
    safe = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    x = (rows - bias.float()) / safe
    codes = (torch.round(x) if rounding == "nearest" else torch.floor(x + noise)).clamp_(0, levels)
    codes = torch.where(scale_f > 0, codes, torch.zeros_like(codes)).to(torch.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes, torch.cat([scale, bias], dim=1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_quantize_rows_gives_the_bits_it_gave(bits, rounding):
    """The CPU quantizer (a tree of elementwise min/max, in-place rounding,
    int4 packed in fp32 when every code is finite) against the ops it
    replaced, on rows with the cases its shortcuts must leave alone: -0.0
    beside 0.0 as a row's min or max, constant rows, NaN, +-inf, odd widths."""
    g = torch.Generator().manual_seed(3)
    for width in (128, 16, 2, 6) if bits == 4 else (128, 7, 1):
        x = torch.randn(64, width, generator=g)
        noise = uniform_noise(counter_hash(5, torch.zeros(64, dtype=torch.int64), torch.arange(64), 2, width))
        x[1] = 3.0  # constant: scale 0
        x[2, :] = x[2].abs()
        x[2, 0], x[2, -1] = 0.0, -0.0  # min is a zero of either sign
        x[3, :] = -x[3].abs()
        x[3, 0], x[3, -1] = -0.0, 0.0  # max is a zero
        x[4, 0] = float("nan")
        x[5, -1] = float("inf")
        x[6, 0] = float("-inf")
        x[7, :] = 0.0
        x[7, width // 2] = -0.0
        got = quantize_rows(x, bits, rounding, noise)
        want = _quantize_as_before(x, bits, rounding, noise)
        assert torch.equal(got[0], want[0]), (width, "codes")
        assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16)), (width, "scale/bias bits")
        finite = x[8:]  # only finite rows: int4's fp32 packing
        got = quantize_rows(finite, bits, rounding, noise[8:])
        want = _quantize_as_before(finite, bits, rounding, noise[8:])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))


def test_quantizing_rows_alone_or_together_gives_the_same_bits():
    x = rows(64, 16, seed=2)
    key = RoundingKey(4, torch.zeros(64, dtype=torch.int64), torch.arange(64), 11)
    for precision in ("int8", "int4", "fp16"):
        together = make_rows(x, precision, "stochastic", key)
        for r in (0, 17, 63):
            alone = make_rows(x[r : r + 1], precision, "stochastic",
                              RoundingKey(4, torch.tensor([0]), torch.tensor([r]), 11))
            for name, t in alone.tensors().items():
                assert torch.equal(t[0], together.tensors()[name][r]), (precision, name)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("recsys-cache")


@pytest.fixture(scope="module")
def fp32_auc(cache_dir):
    from recsys_cli.train.trainer import Trainer

    return Trainer(config(cache_dir, trainer__epochs=2, placement__kind="lookahead",
                          placement__cache_ratio=0.2)).fit()["final"]["val"]["auc"]


@pytest.mark.parametrize("precision, tolerance", [("int8", 0.005), ("int4", 0.02)])
def test_low_precision_tables_learn_as_well_as_fp32(cache_dir, fp32_auc, precision, tolerance):
    """Two epochs of the synthetic task behind a lookahead cache: validation
    AUC within `tolerance` of fp32's (the same run with fp32 tables)."""
    from recsys_cli.train.trainer import Trainer

    summary = Trainer(config(cache_dir, trainer__epochs=2, placement__kind="lookahead", placement__cache_ratio=0.2,
                             precision__kind=precision)).fit()
    auc = summary["final"]["val"]["auc"]
    assert fp32_auc > 0.7
    assert abs(auc - fp32_auc) < tolerance, (auc, fp32_auc)


BATCHES = make_batches(25, batch_size=16)


def test_lfu_admission_keeps_some_rows_in_low_precision():
    model, opt = build({"kind": "device"}, {"kind": "int8", "cache_ratio": 0.1, "policy": "lfu"})
    run(BATCHES, model_opt=(model, opt))
    stats = model.embeddings.stats()
    assert stats["not_admitted"] > 0 and stats["hits"] > 0


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_quantized_tables_load_bit_exact_into_another_placement(precision):
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
    model, _ = build({"kind": "host"}, {"kind": precision, "cache_ratio": 0.05})
    mem = model.embeddings.memory()
    rows = sum(VOCAB)
    # dim 8: codes (8, 4 or 2 x 8 bytes) plus an fp16 scale and bias per row.
    assert mem["table"] == rows * row_bytes
    if precision == "fp32":
        assert mem["cache"] == 0 and mem["device"] == 0
    else:
        assert mem["cache"] == round(rows * 0.05) * 8 * 4  # fp32 cache slots, on the device
        assert mem["device"] == mem["cache"] and mem["host"] == mem["table"] + mem["index"]


def test_a_store_keys_its_writes_where_the_ids_are_never_copying_them_to_the_host():
    """A device-resident low-precision store (the store of a cache on the GPU)
    computes the rounding key of every write: with ids.cpu() that was a device
    sync per write. The key is the same as the table/row arithmetic on the host.
    (On the CPU the hashes are computed in numpy on views of the tensors.)"""
    from torch.overrides import TorchFunctionMode

    from recsys_cli.embeddings.store import RowStore

    class Watch(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.moves = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            to_device = name == "to" and any(isinstance(a, (str, torch.device)) for a in (*args[1:], *(kwargs or {}).values()))
            # numpy() of a CPU tensor is a view, no copy (the CPU's hashes run in numpy)
            on_host = name == "numpy" and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
            if name in ("cpu", "cuda", "tolist", "item", "numpy") and not on_host or to_device:
                self.moves.append(name)
            return func(*args, **(kwargs or {}))

    store = RowStore(30, 4, torch.zeros(30, 1), precision="int8", seed=5, table_rows=[(0, 10), (3, 12), (7, 8)])
    ids = torch.tensor([29, 0, 9, 10, 21, 22, 5])
    store.key(ids, 1)  # the first key per device copies the table starts there once
    watch = Watch()
    with watch:
        key = store.key(ids, 4)
        store.write(ids, torch.randn(7, 4), torch.zeros(7, 1), step=4)
    assert watch.moves == []
    starts, numbers = [0, 10, 22], [0, 3, 7]
    table = [max(t for t in range(3) if starts[t] <= i) for i in ids.tolist()]
    assert torch.equal(key.table, torch.tensor([numbers[t] for t in table]))
    assert torch.equal(key.row, torch.tensor([i - starts[t] for i, t in zip(ids.tolist(), table)]))
