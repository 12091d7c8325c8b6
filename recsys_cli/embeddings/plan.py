"""LookupPlan: what one batch needs from one table group, computed ahead of the trainer.

Planning is a pure function of the batch, so it runs on the loader thread:
fused row ids (feature id + its table's row offset), their unique set and the
inverse index that points every id at its unique row. Lookups, pooling and
updates then run once per unique row, on every placement, in the same order:
the unique ids are sorted raw row ids, never cache slots, so the arithmetic
does not depend on where rows live.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LookupPlan:
    unique: torch.Tensor  # int64 [n] fused row ids, sorted
    inverse: torch.Tensor  # int64 [nnz] index into `unique` for every id of the batch
    offsets: torch.Tensor  # int64 [bags] start of every bag in `inverse`
    bag_of_id: torch.Tensor  # int64 [nnz] the bag every id belongs to
    num_features: int
    # Set when pooled bags are unique bags (dedup): bag b of feature f for
    # sample s is bag_inverse[f, s] (global over the group's bags).
    bag_inverse: torch.Tensor | None = None
    slots: torch.Tensor | None = None  # cache slots of `unique`, set by a cache
    ready: Any = None  # a CUDA event the trainer waits on before reading slots
    extras: dict = field(default_factory=dict)

    @property
    def num_unique(self) -> int:
        return self.unique.numel()

    @property
    def num_ids(self) -> int:
        return self.inverse.numel()

    def to(self, device: torch.device, non_blocking: bool = False) -> "LookupPlan":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return LookupPlan(
            unique=self.unique,  # stays on the host: the stores index with it
            inverse=move(self.inverse),
            offsets=move(self.offsets),
            bag_of_id=move(self.bag_of_id),
            num_features=self.num_features,
            bag_inverse=move(self.bag_inverse),
            slots=self.slots,
            ready=self.ready,
            extras=self.extras,
        )


def plan_lookup(
    values: torch.Tensor,
    lengths: torch.Tensor,
    ids_per_feature: torch.Tensor,
    feature_row_offset: torch.Tensor,
    bag_inverse: torch.Tensor | None = None,
) -> LookupPlan:
    """Plan the lookups of a key-major jagged slice of the batch.

    values: ids local to each feature's table, key-major; lengths: every bag's
    length in the same order; ids_per_feature: int64 [F] how many ids each
    feature has; feature_row_offset: int64 [F] row offset of each feature's
    table in the fused store. With deduplicated bags, lengths lists the unique
    bags and bag_inverse [F, B] maps samples to them.
    """
    fused = values + torch.repeat_interleave(feature_row_offset, ids_per_feature)
    unique, inverse = torch.unique(fused, sorted=True, return_inverse=True)
    offsets = torch.zeros(lengths.numel(), dtype=torch.int64)
    torch.cumsum(lengths[:-1], 0, out=offsets[1:])
    bag_of_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return LookupPlan(
        unique=unique, inverse=inverse, offsets=offsets, bag_of_id=bag_of_id,
        num_features=feature_row_offset.numel(), bag_inverse=bag_inverse,
    )
