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
"""

from __future__ import annotations

import torch


def _round(x: torch.Tensor, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    if rounding == "nearest":
        return torch.round(x)
    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return torch.floor(x + noise)


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


def quantize_rows(
    rows: torch.Tensor, bits: int, rounding: str = "stochastic", generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [n, D] -> (codes uint8 [n, D] or [n, D/2] packed for 4 bits, scale_bias fp16 [n, 2])."""
    levels = (1 << bits) - 1
    lo = rows.amin(dim=1, keepdim=True)
    hi = rows.amax(dim=1, keepdim=True)
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
    scale_f = scale.float()
    # A constant row has scale 0: every code is 0 and the bias holds the value.
    safe = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    codes = _round((rows - bias.float()) / safe, rounding, generator).clamp_(0, levels)
    codes = torch.where(scale_f > 0, codes, torch.zeros_like(codes)).to(torch.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes, torch.cat([scale, bias], dim=1)


def dequantize_rows(codes: torch.Tensor, scale_bias: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=2).flatten(1)
    sb = scale_bias.float()
    return codes.float() * sb[:, :1] + sb[:, 1:]


def round_to_fp16(x: torch.Tensor, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    if rounding == "nearest":
        return x.half()
    # fp16 keeps 10 of fp32's 23 mantissa bits: add uniform noise to the 13
    # dropped bits, then truncate (toward zero, exact on the magnitude).
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 13, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    truncated = ((bits + noise) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x), truncated, x).half()


class QuantizedRows:
    """Rows of one precision; read returns fp32, write takes fp32."""

    precision: str

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that hold the rows (checkpoints, byte counts)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def pin_memory(self) -> None:
        for name, t in self.tensors().items():
            setattr(self, name, t.pin_memory())


class FP32Rows(QuantizedRows):
    precision = "fp32"

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.index_select(0, ids)

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.weights.index_copy_(0, ids, rows)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weights": self.weights}


class FP16Rows(QuantizedRows):
    precision = "fp16"

    def __init__(self, weights: torch.Tensor, rounding: str, generator: torch.Generator | None) -> None:
        self.rounding, self.generator = rounding, generator
        self.weights = round_to_fp16(weights, rounding, generator)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.index_select(0, ids).float()

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.weights.index_copy_(0, ids, round_to_fp16(rows, self.rounding, self.generator))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weights": self.weights}


class IntRows(QuantizedRows):
    def __init__(self, weights: torch.Tensor, bits: int, rounding: str, generator: torch.Generator | None) -> None:
        if bits == 4 and weights.shape[1] % 2:
            raise ValueError(f"int4 rows need an even embedding dim, got {weights.shape[1]}")
        self.bits, self.rounding, self.generator = bits, rounding, generator
        self.precision = f"int{bits}"
        # Quantize in chunks: a full-size fp32 temporary of a huge table is
        # exactly the memory this precision exists to save.
        n, dim = weights.shape
        width = dim // 2 if bits == 4 else dim
        self.codes = torch.empty((n, width), dtype=torch.uint8, device=weights.device)
        self.scale_bias = torch.empty((n, 2), dtype=torch.float16, device=weights.device)
        for start in range(0, n, 1 << 18):
            end = min(n, start + (1 << 18))
            self.codes[start:end], self.scale_bias[start:end] = quantize_rows(
                weights[start:end], bits, rounding, generator
            )

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.codes.index_select(0, ids), self.scale_bias.index_select(0, ids), self.bits)

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        codes, scale_bias = quantize_rows(rows, self.bits, self.rounding, self.generator)
        self.codes.index_copy_(0, ids, codes)
        self.scale_bias.index_copy_(0, ids, scale_bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scale_bias": self.scale_bias}


def make_rows(
    weights: torch.Tensor, precision: str, rounding: str = "stochastic", generator: torch.Generator | None = None
) -> QuantizedRows:
    if precision == "fp32":
        return FP32Rows(weights)
    if precision == "fp16":
        return FP16Rows(weights, rounding, generator)
    if precision in ("int8", "int4"):
        return IntRows(weights, int(precision[3:]), rounding, generator)
    raise ValueError(f"unknown precision {precision!r}")
