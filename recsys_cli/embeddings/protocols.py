"""What other modules may call on a row store and on a cached group, as
typing.Protocol classes that mypy checks (`make test` runs it).

A row store holds every row of a group of tables and the rows' optimizer
state: RowStore (store.py) in memory, DiskRowStore (disk_store.py) in a file
behind a host cache. A cached group (CachedGroup, cache.py) keeps fp32
copies of some of those rows in device slots. Its callers each see one part:

  StepCache        the collection, during a step: gather, update, release
  PrefetchedCache  the prefetcher (prefetch.py), filling ahead on its thread
  ReplicatedCache  cache_avg (strategies/cache_avg.py, cache_fill.py): rank 0's
                   fills applied on the other ranks, rows held (by the
                   strategy's RowHold) and averaged
  CheckpointedCache  checkpoints, resume and evaluation: reads and snapshots
                   that change nothing, and their restore

CachedGroupProtocol is all of them. The concrete classes are checked against
these by the functions at the end of store.py, disk_store.py and cache.py
(under TYPE_CHECKING): a method renamed or re-typed on one side fails mypy.
This module imports no concrete store or cache, so any of them may import it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from recsys_cli.embeddings.plan import Fill, LookupPlan
from recsys_cli.embeddings.table_init import TableSpec

__all__ = ["CachedGroupProtocol", "CheckpointedCache", "PrefetchedCache", "ReplicatedCache", "RowHold",
           "RowStoreProtocol", "SnapshotPatch", "StepCache"]

# What a cache hands a store's table_snapshot for its dirty rows: a function
# giving (local row ids, the rows encoded in the store's precision, their
# optimizer state), or None when no row of the table is dirty.
SnapshotPatch = Callable[[], "tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor] | None"]


class RowStoreProtocol(Protocol):
    """Rows [num_rows, dim] in one precision with their optimizer state. Reads
    give fp32; writes take fp32 and store it in the store's precision, the
    rounding keyed by `step` (stochastic rounding needs it)."""

    num_rows: int
    seed: int
    device: torch.device

    @property
    def precision(self) -> str: ...

    @property
    def state_width(self) -> int:
        """fp32 optimizer values per row (0: SGD, 1: row-wise Adagrad)."""
        ...

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 rows and optimizer state of `ids`."""
        ...

    def read_rows(self, ids: torch.Tensor) -> torch.Tensor: ...

    def read_state(self, ids: torch.Tensor) -> torch.Tensor: ...

    def write(self, ids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, step: int | None = None) -> None: ...

    def encode(self, ids: torch.Tensor, rows: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        """What write(ids, rows, ..., step) would store, without storing it."""
        ...

    def nbytes(self) -> int: ...

    def memory(self, tier: str) -> list[tuple[str, str, int]]:
        """(tier, what, bytes) of each allocation."""
        ...

    def stats(self) -> dict: ...

    def table_snapshot(self, spec: TableSpec, lo: int, hi: int, patch: SnapshotPatch | None = None) -> Any:
        """Table `spec` (fused rows [lo, hi)) for a checkpoint, dirty cached
        rows beside it (a host store's "patch") or written into its files (a
        disk store); changes nothing."""
        ...

    def load_table(self, spec: TableSpec, lo: int, hi: int, saved: Any) -> None:
        """Restore what table_snapshot gave, from any placement or precision."""
        ...


class StepCache(Protocol):
    """The collection, on the trainer's thread, for every batch."""

    lookahead: bool  # True: the prefetcher prepares plans ahead; False: the collection prepares on demand
    dim: int
    device: torch.device

    def prepare(self, plan: LookupPlan) -> Fill: ...

    def gather(self, plan: LookupPlan) -> torch.Tensor:
        """fp32 [len(plan.unique), dim] rows of the plan, on the device."""
        ...

    def update(self, plan: LookupPlan, rows: torch.Tensor, grad: torch.Tensor) -> None: ...

    def release(self, plan: LookupPlan) -> None:
        """Unpin the plan's rows after its update."""
        ...


class PrefetchedCache(Protocol):
    """The prefetcher's thread: prepare() ahead of the trainer, within the window."""

    window: int  # batches a prepare may run ahead of the trainer
    last_window: int  # the window the last prepare used (shrunk to make room)

    def prepare(self, plan: LookupPlan) -> Fill: ...

    def release(self, plan: LookupPlan) -> None: ...

    def interrupt_waits(self) -> None:
        """A prepare waiting for the trainer raises PrefetchStopped (closing)."""
        ...

    def allow_waits(self) -> None: ...


class RowHold(Protocol):
    """Rows a strategy keeps resident beyond the window (cache_avg's rows
    awaiting a cross-rank average), and the state that says which: the
    strategy's, saved in its checkpoint state, not the cache's. The cache
    calls these with its lock held, so they may take only locks of their own
    (never the cache's)."""

    def first_held(self, position: int) -> int:
        """The first batch whose rows may not be evicted once the trainer has
        completed `position` batches (at most `position` while any are held)."""
        ...

    def forget_before(self, batch: int) -> None:
        """No prepare will ask about batches before `batch` again."""
        ...

    def restart(self, batch: int) -> None:
        """The cache was emptied with `batch` batches completed: nothing is held."""
        ...


class ReplicatedCache(Protocol):
    """cache_avg: rank 0 fills, the other ranks apply its fills to their
    replicas; rows touched since the last cross-rank average are held."""

    capacity: int  # slots
    dim: int
    device: torch.device

    @property
    def store(self) -> RowStoreProtocol: ...

    @property
    def row_width(self) -> int:
        """fp32 values a slot holds: the row and its optimizer state."""
        ...

    def prepare(self, plan: LookupPlan) -> Fill: ...

    def loaded_values(self, plan: LookupPlan, fill: Fill) -> torch.Tensor: ...

    def apply(self, plan: LookupPlan, fill: Fill, values: torch.Tensor | None) -> None: ...

    def hold(self, row_hold: RowHold) -> None:
        """From now on `row_hold` says which rows stay resident beyond the
        window, and batches complete by complete(), not at release."""
        ...

    def identity(self) -> dict:
        """What a saved state must match to be of this cache."""
        ...

    def same_cache(self, saved: dict) -> bool: ...

    @property
    def completed(self) -> int:
        """Batches the trainer has completed."""
        ...

    def read_slots(self, slots: torch.Tensor) -> torch.Tensor: ...

    def write_slots(self, slots: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, dirty: bool = False) -> None: ...

    def complete(self, count: int) -> None: ...

    def read(self, ids: torch.Tensor) -> torch.Tensor: ...

    def read_as_saved(self, ids: torch.Tensor) -> torch.Tensor: ...


class CheckpointedCache(Protocol):
    """Checkpoints, resume and evaluation: reads that change nothing (no
    write-back, no dirty bit, no random draw) and the restore of what they read."""

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 current rows of `ids` (cached copy where resident)."""
        ...

    def read_as_saved(self, ids: torch.Tensor) -> torch.Tensor:
        """read(), as a checkpoint of this moment saves the rows (what an evaluation scores)."""
        ...

    def table_state(self, patch_beside: bool = False) -> dict[str, dict[str, torch.Tensor]]: ...

    def cache_snapshot(self) -> dict: ...

    def restores_cache(self, saved: dict | None) -> bool: ...

    def load_cache_snapshot(self, saved: dict | None, step: int) -> bool: ...

    def load_table_state(self, tables: dict[str, dict]) -> None: ...

    def invalidate(self) -> None:
        """Drop every cached row (after the store was loaded behind it)."""
        ...


class CachedGroupProtocol(StepCache, PrefetchedCache, ReplicatedCache, CheckpointedCache, Protocol):
    """Everything a cached group offers to other modules."""
