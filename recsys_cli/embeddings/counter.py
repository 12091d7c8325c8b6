"""Counter-based random numbers: 32-bit integer hashes in int64 torch ops.

Initial table values (tables.py) and stochastic rounding noise (quant.py) are
hashes of what they belong to (seed, table, row, column, step) instead of
draws from a sequential generator, so they do not depend on chunking, order,
placement or thread timing. The arithmetic never leaves int64 (products are
split into 16-bit halves), so CPU and CUDA give the same bits.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def mul32(x: torch.Tensor | int, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32), via 16-bit halves of c so no
    product leaves int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def fmix32(h):
    """murmur3's finaliser: a bijection of [0, 2**32) with full avalanche.
    Works on Python ints and on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)
