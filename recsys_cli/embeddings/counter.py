"""Counter-based random numbers: 32-bit integer hashes in int64 torch ops.

Initial table values (tables.py) and stochastic rounding noise (quant.py) are
hashes of what they belong to (seed, table, row, column, step) instead of
draws from a sequential generator, so they do not depend on chunking, order,
placement or thread timing. The arithmetic never leaves int64 (products are
split into 16-bit halves), so CPU and CUDA give the same bits.

fmix32_int32_ computes the same function on int32 tensors holding the 32-bit
patterns (a value >= 2**31 stored as its two's complement): a product wraps
mod 2**32 (the low half of the machine multiply, on CPU and CUDA alike) and
a right shift is made logical by masking off the sign bits it copies. Half
the bytes and a third of the ops of the int64 form: it is what the
per-element hashes of stochastic rounding use (quant.counter_hash) on a
device other than the CPU.

fmix32_uint32_ is the same function on numpy uint32 arrays, where a right
shift is logical and a product wraps: two ops a xor-shift instead of three,
and a call costs about a microsecond instead of several (a table build's
per-row rounds are on a few thousand values). The CPU's hashes use it
(quant.counter_hash_bits); numpy and torch share the tensors' memory, so
nothing is copied.
"""

from __future__ import annotations

import numpy as np
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


def _as_int32(c: int) -> int:
    """A 32-bit constant as the int32 with the same bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


_FMIX_C1, _FMIX_C2 = _as_int32(0x85EBCA6B), _as_int32(0xC2B2AE35)


def fmix32_int32_(h: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """fmix32 in place on an int32 tensor of 32-bit patterns (scratch: an
    int32 tensor of h's shape, overwritten); returns h. Bit for bit
    fmix32(h & MASK32) as int64, tests/test_precision.py checks."""
    torch.bitwise_right_shift(h, 16, out=scratch)
    h ^= scratch.bitwise_and_(0xFFFF)  # logical shift: keep the 16 bits below the copied sign
    h.mul_(_FMIX_C1)
    torch.bitwise_right_shift(h, 13, out=scratch)
    h ^= scratch.bitwise_and_(0x7FFFF)
    h.mul_(_FMIX_C2)
    torch.bitwise_right_shift(h, 16, out=scratch)
    h ^= scratch.bitwise_and_(0xFFFF)
    return h


_FMIX_U1, _FMIX_U2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def fmix32_uint32_(h: np.ndarray, scratch: np.ndarray, first_shift: bool = True) -> np.ndarray:
    """fmix32 in place on a numpy uint32 array (scratch: h's shape, overwritten);
    returns h. first_shift=False leaves out the first xor-shift, for a caller
    that applied it already (to a value shared by many elements)."""
    if first_shift:
        np.right_shift(h, 16, out=scratch)
        h ^= scratch
    h *= _FMIX_U1
    np.right_shift(h, 13, out=scratch)
    h ^= scratch
    h *= _FMIX_U2
    np.right_shift(h, 16, out=scratch)
    h ^= scratch
    return h
