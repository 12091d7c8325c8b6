"""Batch: what the loader yields and the model consumes.

Work done ahead of the trainer travels with the batch in typed fields, set by
the loader's transform (the embeddings' lookup plans and id counts): nothing
rides in a string-keyed dict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from recsys_cli.data.dedup import InverseKeyedJaggedTensor
from recsys_cli.data.jagged import KeyedJaggedTensor

if TYPE_CHECKING:  # data does not depend on embeddings at run time
    from recsys_cli.embeddings.plan import LookupPlan, Route

Move = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Batch:
    dense: torch.Tensor  # float32 [B, 13]
    sparse: KeyedJaggedTensor | InverseKeyedJaggedTensor  # ids local to each feature's table (IKJT when dedup is on)
    labels: torch.Tensor  # float32 [B]
    session: torch.Tensor | None = None  # int64 [B] when the dataset has sessions
    # One lookup plan per table group (embeddings/plan.py), made on the loader thread.
    plans: list[LookupPlan] | None = None
    # int64 [3, F]: ids in the batch, ids looked up, distinct rows, per feature (the dedup statistics).
    id_counts: torch.Tensor | None = None
    # A sharded run: the ids this rank sends each table's owner, then every rank's slice size (sharded.py).
    route: Route | None = None

    @property
    def size(self) -> int:
        return self.labels.numel()

    def apply(self, fn: Move) -> "Batch":
        """The same batch with fn applied to its own tensors (dense, sparse,
        labels, session); the plans are shared, not mapped."""
        return replace(
            self,
            dense=fn(self.dense),
            sparse=self.sparse.apply(fn),
            labels=fn(self.labels),
            session=None if self.session is None else fn(self.session),
            plans=None if self.plans is None else list(self.plans),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False, move: Move | None = None) -> "Batch":
        """The batch and its plans for a step on `device` (LookupPlan.moved);
        `move` replaces the plain copy (the trainer's copy stream counts and
        records its copies)."""
        move = move or (lambda t: t.to(device, non_blocking=non_blocking))
        moved = self.apply(move)
        if self.plans is not None:
            moved.plans = [p.moved(move) for p in self.plans]
        return moved

    def pin_memory(self, pin: Move = torch.Tensor.pin_memory) -> "Batch":
        """Every tensor `to` copies, page-locked (on the loader thread)."""
        pinned = self.apply(pin)
        if self.plans is not None:
            pinned.plans = [p.pin_memory(pin) for p in self.plans]
        return pinned
