"""The device tests run on: CPU unless RECSYS_TEST_DEVICE names another
(`make gpu-check` runs the suite with RECSYS_TEST_DEVICE=cuda)."""

from __future__ import annotations

import os

import torch

TEST_DEVICE = torch.device(os.environ.get("RECSYS_TEST_DEVICE", "cpu"))


def fresh_cuda_block(nbytes: int) -> int:
    """What a fresh CUDA caching allocator counts for one tensor (CUDACachingAllocator.cpp): a
    multiple of 512 B; above 1 MiB a new segment (20 MiB under 10 MiB, else rounded to 2 MiB)
    is split only if more than 1 MiB would remain."""
    if nbytes == 0:
        return 0
    block = max(512, -(-nbytes // 512) * 512)
    if block <= 2**20:
        return block
    segment = 20 * 2**20 if block < 10 * 2**20 else -(-block // (2 * 2**20)) * 2 * 2**20
    return block if segment - block > 2**20 else segment
