"""Batch: what the loader yields and the model consumes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from recsys_cli.data.dedup import InverseKeyedJaggedTensor
from recsys_cli.data.jagged import KeyedJaggedTensor


@dataclass
class Batch:
    dense: torch.Tensor  # float32 [B, 13]
    sparse: KeyedJaggedTensor | InverseKeyedJaggedTensor  # ids local to each feature's table (IKJT when dedup is on)
    labels: torch.Tensor  # float32 [B]
    session: torch.Tensor | None = None  # int64 [B] when the dataset has sessions
    # Work done ahead of the trainer (embedding lookup plans, cache slots),
    # attached by transforms that run on the loader or prefetcher thread.
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.labels.numel()

    def apply(self, fn) -> "Batch":
        """The same batch with fn applied to its tensors (a move, pinning);
        extras (the transforms' work) are shared, not mapped."""
        return replace(
            self,
            dense=fn(self.dense),
            sparse=self.sparse.apply(fn),
            labels=fn(self.labels),
            session=None if self.session is None else fn(self.session),
            extras=dict(self.extras),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self.apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        return self.apply(torch.Tensor.pin_memory)
