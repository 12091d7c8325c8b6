"""The device tests run on: CPU unless RECSYS_TEST_DEVICE names another
(`make gpu-check` runs the suite with RECSYS_TEST_DEVICE=cuda)."""

from __future__ import annotations

import os

import torch

TEST_DEVICE = torch.device(os.environ.get("RECSYS_TEST_DEVICE", "cpu"))
