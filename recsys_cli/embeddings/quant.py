"""Row storage in fp32, fp16, int8 or int4, with stochastic or nearest rounding.

int8 and int4 rows are quantized row-wise (Yang et al., FBGEMM's layout):
each row keeps unsigned codes plus its own scale and bias, and
value = code * scale + bias. int8 codes are one uint8 per value; int4 codes
are two per byte (even column in the low nibble). Scale and bias are fp16,
as in FBGEMM's fused rows: at dim 16 fp32 metadata would double int4's
footprint. With stochastic rounding the fp16 bias is rounded down and the
scale up, so the codes cover the row's [min, max] and rounding stays
unbiased; nearest rounding keeps the error within half a step.

Stochastic rounding rounds x up with probability equal to its fractional
part, so the stored value is unbiased: E[dequantize(quantize(x))] = x. That
is what lets small SGD updates survive in low precision; nearest rounding
drops every update smaller than half a step.

The noise is counter-based, not drawn from a sequential generator: the value
added to column c of row r of table t when it is written at step s is a hash
of (seed, t, r, s, c). So the bits a row gets do not depend on the order in
which rows are written back (a prefetch thread's timing), on which rows share
a write, or on how tables are fused into groups, and a checkpoint needs no
generator state: the step and the seed are enough.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recsys_cli.embeddings.counter import MASK32, fmix32, fmix32_int32_, fmix32_uint32_

# Steps used as keys by writes that are not a training step's.
INIT_STEP = -1  # the table's first quantization
CONVERT_STEP = -2  # a checkpoint loaded into another precision


def counter_hash(seed: int, table: torch.Tensor, row: torch.Tensor, step: torch.Tensor | int, width: int) -> torch.Tensor:
    """int64 [n, width] of 32-bit hashes of (seed, table[i], row[i], step[i], column).

    table, row: int64 [n]; step: int64 [n] or one int. A pure function of its
    arguments, computed with elementwise integer ops (the same bits on CPU and CUDA)."""
    return counter_hash_bits(seed, table, row, step, width).to(torch.int64) & MASK32


def counter_hash_bits(seed: int, table: torch.Tensor, row: torch.Tensor, step: torch.Tensor | int,
                      width: int) -> torch.Tensor:
    """counter_hash's hashes as int32 bit patterns [n, width] (what stochastic
    rounding reads: uniform_noise, round_to_fp16 mask them). On the CPU in
    numpy uint32 (_cpu_hash_bits); elsewhere the per-row part in int64 (n
    values) and the per-element part, width times more, in int32
    (counter.fmix32_int32_). The same bits either way (tests/test_precision.py)."""
    device = row.device
    if device.type == "cpu":
        return _cpu_hash_bits(seed, table, row, step, width)
    step = torch.as_tensor(step, dtype=torch.int64, device=device).expand(row.shape)
    h = torch.full(row.shape, seed & MASK32, dtype=torch.int64, device=device)
    for word in (table & MASK32, row & MASK32, row >> 32, step & MASK32):
        h = fmix32(h ^ word ^ 0x9E3779B9)  # the constant keeps all-zero keys off fmix32's fixed point 0
    # int64 -> int32 keeps the low 32 bits (the pattern); the column is xored in as before
    h32 = h.to(torch.int32).unsqueeze(1) ^ torch.arange(width, dtype=torch.int32, device=device)
    scratch = torch.empty_like(h32)
    return fmix32_int32_(fmix32_int32_(h32, scratch), scratch)


def _low32(t: torch.Tensor) -> np.ndarray:
    """The low 32 bits of an int64 CPU tensor's values, as a numpy uint32 array."""
    return t.to(torch.int32).contiguous().numpy().view(np.uint32)


_KEY_CONSTANT = np.uint32(0x9E3779B9)


def _cpu_hash_bits(seed: int, table: torch.Tensor, row: torch.Tensor, step: torch.Tensor | int,
                   width: int) -> torch.Tensor:
    """counter_hash_bits on the CPU: every round in numpy uint32
    (counter.fmix32_uint32_), about 3x the int32 torch ops' rate in a table
    build (where the per-row rounds, ~70 small int64 torch ops, cost as much
    as the per-element ones)."""
    n = row.shape[0]
    steps = np.uint32(step & MASK32) if isinstance(step, int) else _low32(step.expand(row.shape))
    h = np.full(n, seed & MASK32, dtype=np.uint32)
    scratch = np.empty_like(h)
    for word in (_low32(table), _low32(row), _low32(row >> 32), steps):
        h ^= word
        h ^= _KEY_CONSTANT  # keeps all-zero keys off fmix32's fixed point 0
        fmix32_uint32_(h, scratch)
    out = torch.empty((n, width), dtype=torch.int32)
    x = out.numpy().view(np.uint32)
    columns = np.arange(width, dtype=np.uint32)
    # fmix32's first step, x ^ (x >> 16), on x = h ^ column: a column < 2**16
    # leaves x >> 16 = h >> 16, so the step is taken once per row.
    folded = width <= 1 << 16
    if folded:
        h ^= h >> 16
    np.bitwise_xor(h[:, None], columns, out=x)
    scratch = np.empty_like(x)
    fmix32_uint32_(x, scratch, first_shift=not folded)
    fmix32_uint32_(x, scratch)
    return out


def uniform_noise(hashes: torch.Tensor) -> torch.Tensor:
    """fp32 in [0, 1) from 32-bit hashes (int64 values or int32 patterns): their top 24 bits, exactly."""
    if hashes.dtype == torch.int32 and hashes.device.type == "cpu" and hashes.is_contiguous():
        # numpy: a logical shift, then the cast and the exact scaling in one pass
        out = torch.empty(hashes.shape, dtype=torch.float32)
        top = np.right_shift(hashes.numpy().view(np.uint32), 8)
        np.multiply(top, np.float32(1.0 / (1 << 24)), out=out.numpy(), dtype=np.float32, casting="unsafe")
        return out
    return ((hashes >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class RoundingKey:
    """What the rounding noise of a write is keyed by: the store's seed, each
    row's table and row within its table, and the step of the write."""

    seed: int
    table: torch.Tensor  # int64 [n]
    row: torch.Tensor  # int64 [n]
    step: torch.Tensor | int

    def hashes(self, width: int) -> torch.Tensor:
        """int32 bit patterns [n, width] (counter_hash_bits)."""
        return counter_hash_bits(self.seed, self.table, self.row, self.step, width)


def _round_(x: torch.Tensor, rounding: str, noise: torch.Tensor | None) -> torch.Tensor:
    """x rounded to integers, in place."""
    if rounding == "nearest":
        return x.round_()
    if noise is None:  # one-off use (no training run's key): torch's global generator
        noise = torch.rand(x.shape, device=x.device, dtype=x.dtype)
    return x.add_(noise).floor_()


def _row_extremes(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's min and max ([n, 1] each), bit for bit rows.amin(1) and
    rows.amax(1): a tree of elementwise minimum/maximum over halves of the
    row (torch's reductions along a 128-value row ran at 4-7 ns a value in a
    table build, the elementwise ops at about 0.1). Equal values are equal
    whichever way they are found, except for which zero (-0.0 or 0.0) or
    which NaN is picked: rows whose min or max is a zero or a NaN take
    amin/amax's own answer (torch 2.13 picks as the tree does in the cases
    tests/test_precision.py tries; the fallback keeps that a non-question)."""
    lo = hi = rows
    while lo.shape[1] > 1:
        half = lo.shape[1] // 2  # an odd middle column is in both halves: min(x, x) = x
        lo = torch.minimum(lo[:, : lo.shape[1] - half], lo[:, half:])
        hi = torch.maximum(hi[:, : hi.shape[1] - half], hi[:, half:])
    # A mask and torch.where, not the rows' indices (nonzero): the training
    # step's write-backs quantize too, and its ops index with host-built
    # tensors only (tests/test_cache_streams.py); the rare row with a zero or
    # NaN extreme costs one amin/amax over the block.
    redo = (lo == 0) | (hi == 0) | lo.isnan() | hi.isnan()
    if bool(redo.any()):
        lo = torch.where(redo, rows.amin(dim=1, keepdim=True), lo)
        hi = torch.where(redo, rows.amax(dim=1, keepdim=True), hi)
    return lo, hi


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    """Largest fp16 value <= x, as fp16."""
    h = x.half()
    too_big = h.float() > x
    return torch.where(too_big, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 value >= x, as fp16."""
    h = x.half()
    too_small = h.float() < x
    return torch.where(too_small, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def _grid(lo: torch.Tensor, hi: torch.Tensor, levels: int, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's fp16 (scale, bias) from its min and max ([n, 1] each)."""
    if rounding == "stochastic":
        # The grid must cover [lo, hi] exactly, or clamping would bias the ends.
        bias = _fp16_down(lo)
        scale = _fp16_up((hi - bias.float()) / levels)
    else:
        # Nearest: a grid that misses an end by less than half a step keeps the
        # half-step error bound and, unlike always widening it, re-quantizes a
        # row that barely changed to the same grid (no creeping growth).
        bias = lo.half()
        bias = torch.where(lo < bias.float() - ((hi - lo) / levels) / 2, _fp16_down(lo), bias)
        scale = ((hi - bias.float()) / levels).half()
        short = hi - (bias.float() + levels * scale.float())
        scale = torch.where(short > scale.float() / 2, _fp16_up((hi - bias.float()) / levels), scale)
    return scale, bias


def quantize_rows(
    rows: torch.Tensor, bits: int, rounding: str = "stochastic", noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [n, D] -> (codes uint8 [n, D] or [n, D/2] packed for 4 bits, scale_bias fp16 [n, 2]).

    noise: uniform [0, 1) of rows' shape for stochastic rounding (see
    RoundingKey); every row is quantized on its own, so quantizing rows one at
    a time or all together gives the same bits."""
    levels = (1 << bits) - 1
    on_cpu = rows.device.type == "cpu"  # elsewhere: no branch on a value (each would wait for the device)
    if on_cpu and rows.shape[1]:
        lo, hi = _row_extremes(rows)
    else:
        lo, hi = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
    scale, bias = _grid(lo, hi, levels, rounding)
    scale_f = scale.float()
    # A constant row has scale 0: every code is 0 and the bias holds the value.
    # (One temporary, rounded and clamped in place: the same ops as out of place.)
    positive = scale_f > 0
    every_row = on_cpu and bool(positive.all())
    safe = scale_f if every_row else torch.where(positive, scale_f, torch.ones_like(scale_f))
    codes = _round_(torch.sub(rows, bias.float()).div_(safe), rounding, noise).clamp_(0, levels)
    if not every_row:
        codes.masked_fill_(~positive, 0)
    if bits == 4 and every_row and bool(torch.isfinite(scale_f).all()):
        # Every code is an integer in [0, 15] (a finite grid: no inf - inf):
        # even + 16 * odd in fp32 is exactly even | odd << 4, and only half
        # the values are converted to uint8.
        return torch.add(codes[:, 0::2], codes[:, 1::2], alpha=16).to(torch.uint8), torch.cat([scale, bias], dim=1)
    codes = codes.to(torch.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes, torch.cat([scale, bias], dim=1)


def dequantize_rows(codes: torch.Tensor, scale_bias: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=2).flatten(1)
    sb = scale_bias.float()
    return codes.float() * sb[:, :1] + sb[:, 1:]


def round_to_fp16(x: torch.Tensor, rounding: str, hashes: torch.Tensor | None = None) -> torch.Tensor:
    """hashes: x's shape of 32-bit hashes, int64 or int32 patterns (RoundingKey.hashes), for stochastic rounding."""
    if rounding == "nearest":
        return x.half()
    # fp16 keeps 10 of fp32's 23 mantissa bits: add uniform noise to the 13
    # dropped bits, then truncate (toward zero, exact on the magnitude).
    bits = x.contiguous().view(torch.int32)
    if hashes is None:  # one-off use: torch's global generator
        noise = torch.randint(0, 1 << 13, x.shape, device=x.device, dtype=torch.int32)
    else:
        noise = (hashes & 0x1FFF).to(torch.int32)
    truncated = ((bits + noise) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x), truncated, x).half()


class QuantizedRows:
    """Rows of one precision; read returns fp32, write takes fp32 and the
    RoundingKey of the write (None: one-off use, torch's global generator)."""

    precision: str
    rounding: str = "nearest"

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write(self, ids: torch.Tensor, rows: torch.Tensor, key: RoundingKey | None = None) -> None:
        raise NotImplementedError

    def encode(self, rows: torch.Tensor, key: RoundingKey | None = None) -> dict[str, torch.Tensor]:
        """rows in this precision's native tensors, without storing them (snapshots)."""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that hold the rows (checkpoints, byte counts)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


    def _store(self, ids: torch.Tensor, encoded: dict[str, torch.Tensor]) -> None:
        for name, t in self.tensors().items():
            t.index_copy_(0, ids, encoded[name])


class FP32Rows(QuantizedRows):
    precision = "fp32"

    def __init__(self, num_rows: int, dim: int, device: torch.device | str = "cpu", empty=None) -> None:
        self.weights = _allocator(device, empty)((num_rows, dim), torch.float32)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.index_select(0, ids)

    def encode(self, rows: torch.Tensor, key: RoundingKey | None = None) -> dict[str, torch.Tensor]:
        return {"weights": rows}

    def write(self, ids: torch.Tensor, rows: torch.Tensor, key: RoundingKey | None = None) -> None:
        self.weights.index_copy_(0, ids, rows)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weights": self.weights}


class FP16Rows(QuantizedRows):
    precision = "fp16"

    def __init__(self, num_rows: int, dim: int, rounding: str, device: torch.device | str = "cpu", empty=None) -> None:
        self.rounding = rounding
        self.weights = _allocator(device, empty)((num_rows, dim), torch.float16)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.index_select(0, ids).float()

    def encode(self, rows: torch.Tensor, key: RoundingKey | None = None) -> dict[str, torch.Tensor]:
        hashes = key.hashes(rows.shape[1]) if key is not None and self.rounding == "stochastic" else None
        return {"weights": round_to_fp16(rows, self.rounding, hashes)}

    def write(self, ids: torch.Tensor, rows: torch.Tensor, key: RoundingKey | None = None) -> None:
        self._store(ids, self.encode(rows, key))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weights": self.weights}


class IntRows(QuantizedRows):
    def __init__(self, num_rows: int, dim: int, bits: int, rounding: str, device: torch.device | str = "cpu",
                 empty=None) -> None:
        if bits == 4 and dim % 2:
            raise ValueError(f"int4 rows need an even embedding dim, got {dim}")
        self.bits, self.rounding = bits, rounding
        self.precision = f"int{bits}"
        width = dim // 2 if bits == 4 else dim
        empty = _allocator(device, empty)
        self.codes = empty((num_rows, width), torch.uint8)
        self.scale_bias = empty((num_rows, 2), torch.float16)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.codes.index_select(0, ids), self.scale_bias.index_select(0, ids), self.bits)

    def encode(self, rows: torch.Tensor, key: RoundingKey | None = None) -> dict[str, torch.Tensor]:
        noise = uniform_noise(key.hashes(rows.shape[1])) if key is not None and self.rounding == "stochastic" else None
        codes, scale_bias = quantize_rows(rows, self.bits, self.rounding, noise)
        return {"codes": codes, "scale_bias": scale_bias}

    def write(self, ids: torch.Tensor, rows: torch.Tensor, key: RoundingKey | None = None) -> None:
        self._store(ids, self.encode(rows, key))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scale_bias": self.scale_bias}


def _allocator(device, empty):
    """empty(shape, dtype): the given allocator (pinned host memory), else torch.empty on `device`."""
    return empty or (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device))


def empty_rows(num_rows: int, dim: int, precision: str, rounding: str = "stochastic",
               device: torch.device | str = "cpu", empty=None) -> QuantizedRows:
    """Uninitialised rows of one precision (fill them with write); `empty`
    allocates them elsewhere than torch.empty (pinned host memory, in place)."""
    if precision == "fp32":
        return FP32Rows(num_rows, dim, device, empty)
    if precision == "fp16":
        return FP16Rows(num_rows, dim, rounding, device, empty)
    if precision in ("int8", "int4"):
        return IntRows(num_rows, dim, int(precision[3:]), rounding, device, empty)
    raise ValueError(f"unknown precision {precision!r}")


def make_rows(weights: torch.Tensor, precision: str, rounding: str = "stochastic",
              key: RoundingKey | None = None) -> QuantizedRows:
    """fp32 weights [n, D] in one precision (one-off use: a training store
    quantizes chunk by chunk with its own keys, see store.py)."""
    rows = empty_rows(weights.shape[0], weights.shape[1], precision, rounding, weights.device)
    rows.write(torch.arange(weights.shape[0], device=weights.device), weights, key)
    return rows


def decode_saved(saved: dict, dim: int) -> torch.Tensor:
    """fp32 rows of a table saved in native tensors ({"precision", field: tensor})."""
    rows = make_rows(torch.zeros(0, dim), saved["precision"])
    for k in rows.tensors():
        setattr(rows, k, saved[k])
    first = next(iter(rows.tensors().values()))
    return rows.read(torch.arange(first.shape[0], device=first.device))



def patched_entry(saved: dict, in_place: bool = False) -> dict:
    """A table entry with its "patch" (rows a cache held dirty: local ids
    "rows", their encoded fields and state) put into its tensors. A
    checkpoint saves a host table as views of the live store plus that
    patch, so saving never copies the table (issue 27: a clone of every
    low-precision table was the checkpoint's peak). in_place: the entry's
    tensors are its own (just loaded from a file) and are patched where
    they are; otherwise (a live snapshot: views of a store) the patched
    fields are copied first."""
    patch = saved.get("patch")
    if patch is None:
        return saved
    out = {k: v for k, v in saved.items() if k != "patch"}
    local = patch["rows"]
    for name, values in patch.items():
        if name == "rows":
            continue
        target = out[name] if in_place else out[name].clone()
        target[local] = values.to(target.device)
        out[name] = target
    return out
