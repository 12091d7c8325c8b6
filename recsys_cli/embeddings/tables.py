"""Table groups: the tables of one placement behind one fused row store.

A group owns a set of tables, fused into one row space with per-table row
offsets. The collection asks each group for the rows of a batch's plan
(`gather`) and hands back their gradients (`update`); where the rows live,
and how they get to the device, is the group's business:

  DirectGroup   rows read from the store and written back every step; the
                store lives on the device ("device"), in host memory ("host":
                gathered on the host and copied), or in host memory the
                device addresses ("uvm": gathered and updated by kernels).
  CachedGroup   (cache.py) a device cache of fp32 rows in front of the store,
                filled ahead by the lookahead prefetcher or on demand.
"""

from __future__ import annotations

import abc
import functools
from typing import Any

import torch

from recsys_cli.device import PinnedStaging, runtime_for, with_index
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.plan import LookupPlan
from recsys_cli.embeddings.quant import patched_entry
from recsys_cli.embeddings.protocols import RowStoreProtocol
from recsys_cli.embeddings.store import RowStore
from recsys_cli.embeddings.table_init import TableSpec


class TableGroup(abc.ABC):
    """The tables of one placement behind one store (see the module docstring).
    The collection talks to a group only through these methods."""

    kind: str = "base"  # the placement's name: device, uvm, cache, lookahead
    lookahead: bool = False  # True: the prefetcher prepares its plans ahead, on its thread

    def __init__(
        self, tables: list[TableSpec], feature_tables: list[str], store: RowStoreProtocol,
        optimizer: RowOptimizer, device: torch.device, *, store_tier: str = "device",
    ) -> None:
        self.tables = tables
        self.store_tier = store_tier  # where the store counts: "device" or "host"
        self.optimizer = optimizer
        self.store = store
        self.device = with_index(device)
        self.dim = tables[0].dim
        self.row_offset: dict[str, int] = {}
        offset = 0
        for t in tables:
            self.row_offset[t.name] = offset
            offset += t.num_rows
        self.num_rows = offset
        self.feature_row_offset = torch.tensor([self.row_offset[t] for t in feature_tables], dtype=torch.int64)
        # Which feature a fused row belongs to (statistics): offsets sorted, and
        # the feature index of each sorted offset. Features sharing a table
        # count toward one of them.
        order = torch.argsort(self.feature_row_offset, stable=True)
        self.feature_row_offset_sorted = self.feature_row_offset[order]
        self.feature_order = order

    # --- the step: called by the collection -------------------------------
    def prepare(self, plan: LookupPlan) -> None:
        """Make the plan's rows readable (a cache fills and pins them)."""

    @abc.abstractmethod
    def gather(self, plan: LookupPlan) -> torch.Tensor:
        """fp32 rows of plan.unique on the device."""

    @abc.abstractmethod
    def update(self, plan: LookupPlan, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply the row optimizer to the rows `gather` returned."""

    def release(self, plan: LookupPlan) -> None:
        """The trainer is done with the plan's rows."""

    @abc.abstractmethod
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Current fp32 rows, no side effects (checks, the tests' tables;
        an evaluation reads read_as_saved)."""

    def read_as_saved(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows an evaluation scores: `ids` as a checkpoint of this moment
        saves them, so `recsys evaluate` on it gives the run's figures. A
        store's rows are what it saves; a low-precision cache rounds its
        dirty rows (CachedGroup)."""
        return self.read(ids)

    # --- whole-table access: checkpoints and reports -----------------------
    def table_state(self, patch_beside: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """Per table, the current rows in the store's native tensors (rows in
        their precision and the optimizer state), as the store snapshots them
        (RowStore.table_snapshot: views of a host store; a disk store: the rows
        changed since its last checkpoint, written by the checkpoint). Reading
        it changes nothing in the live run; rows that live elsewhere (a cache's
        dirty rows) are patched into the snapshot. Like the host store's
        views, a snapshot holds the run's current values only until the run
        goes on: write it at once (the trainer's save is synchronous).
        patch_beside: a host store's dirty rows come as the entry's "patch"
        instead of a copy of the table with them put in (checkpoints: readers
        put it in, quant.patched_entry)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for t in self.tables:
            lo, hi = self.row_offset[t.name], self.row_offset[t.name] + t.num_rows
            entry = self.store.table_snapshot(t, lo, hi, functools.partial(self._snapshot_patch, lo, hi))
            out[t.name] = entry if patch_beside or not isinstance(entry, dict) else patched_entry(entry)
        return out

    def _snapshot_patch(self, lo: int, hi: int):
        """(local ids, encoded rows, state) of rows of [lo, hi) that live
        elsewhere than the store (a cache), or None. The store calls it: a host
        store at once, a disk store when the checkpoint writes that table, so
        only one table's dirty rows are copied at a time."""
        return None

    def cache_snapshot(self) -> dict | None:
        """What a checkpoint needs beyond table_state to resume exactly (a cache's slots)."""
        return None

    def load_cache_snapshot(self, saved: dict | None, step: int) -> bool:
        return saved is None

    def restores_cache(self, saved: dict | None) -> bool:
        """Whether load_cache_snapshot(saved) brings back a cache exactly (a group without one: never)."""
        return False

    def load_table_state(self, tables: dict[str, dict]) -> None:
        """Load what table_state wrote, from any placement (RowStore.load_table)."""
        for t in self.tables:
            lo = self.row_offset[t.name]
            self.store.load_table(t, lo, lo + t.num_rows, tables[t.name])
        self.invalidate()

    def invalidate(self) -> None:
        """Forget cached rows after the store was overwritten."""

    def memory(self) -> list[tuple[str, str, int]]:
        """Bytes actually allocated, one entry per tensor: (tier "device"|"host", what "table"|"cache"|"index", bytes)."""
        return self.store.memory(self.store_tier)

    def stats(self) -> dict:
        return self.store.stats()


class DirectGroup(TableGroup):
    """No cache: rows go between the store and the trainer every step. The
    store is fp32 (a low-precision table always sits behind a cache). With the
    store in host memory and the trainer on CUDA, rows and their optimizer
    state are gathered into reusable pinned buffers, so their copies to the
    device are asynchronous."""

    store: RowStore  # in memory: the step reads its tensors directly
    # (ids, rows, state, copied): a step's update on its way to the host table
    _update_in_flight: tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any] | None

    def __init__(self, *args, kind: str = "device", **kwargs) -> None:
        super().__init__(*args, store_tier="device" if kind == "device" else "host", **kwargs)
        self.kind = kind
        self.bytes_to_device = 0
        self.bytes_to_host = 0
        self.use_runtime(runtime_for(self.device))

    def use_runtime(self, runtime) -> None:
        """Copies and staging buffers from `runtime` (tests install a recording
        one): a host store behind a device (pins_host) gets pinned buffers for
        rows and optimizer state, each way."""
        self.runtime = runtime
        staged = self.store.device.type == "cpu" and runtime.pins_host and not self.store.mapped
        cols = self.store.state.shape[1]
        self.staging = (PinnedStaging(runtime, self.dim), PinnedStaging(runtime, cols)) if staged else None
        self.back_staging = (PinnedStaging(runtime, self.dim), PinnedStaging(runtime, cols)) if staged else None
        self._update_in_flight = None

    def flush(self) -> None:
        """Write the last step's updated rows into the host table once their
        copy off the device has landed. The step enqueues that copy and goes
        on (update); whatever reads the table next (the next gather, a
        checkpoint, an evaluation) waits for it here, so the host meanwhile
        runs ahead to the next batch instead of waiting for the device at
        the end of every step."""
        if self._update_in_flight is not None:
            ids, rows, state, copied = self._update_in_flight
            self._update_in_flight = None
            copied.synchronize()
            self.store.write(ids, rows, state)  # fp32: no rounding key

    def _ids(self, plan: LookupPlan) -> torch.Tensor:
        """plan.unique where the store is: the copy the trainer made once per step."""
        if plan.unique.device == self.store.device:
            return plan.unique
        if plan.unique_device is not None:
            return plan.unique_device
        return self.runtime.to_device(self.runtime.pin(plan.unique), self.store.device)

    def _gather(self, source: torch.Tensor, ids: torch.Tensor, staging: PinnedStaging | None) -> torch.Tensor:
        if staging is None:  # the store where the device reads it (device, uvm), or no device (CPU)
            rows = source.index_select(0, ids)
            return rows if rows.device == self.device else self.runtime.to_device(rows, self.device)
        view = staging.take(ids.numel())
        torch.index_select(source, 0, ids, out=view)
        return staging.to_device(view, self.device)

    def gather(self, plan: LookupPlan) -> torch.Tensor:
        self.flush()
        ids = self._ids(plan)
        if self.store_tier == "host":  # counted on CPU runs too: the traffic a GPU would see
            self.bytes_to_device += ids.numel() * self.dim * 4
        return self._gather(self.store.weights, ids, self.staging and self.staging[0])

    def update(self, plan: LookupPlan, rows: torch.Tensor, grad: torch.Tensor) -> None:
        self.flush()
        ids = self._ids(plan)
        state = self._gather(self.store.state, ids, self.staging and self.staging[1])
        rows, state = self.optimizer.step(rows, state, grad)
        if self.store_tier == "host":
            self.bytes_to_host += rows.numel() * 4
        if self.back_staging is not None:  # through pinned buffers, written to the host table once they land (flush)
            rows, state = (b.from_device(t) for b, t in zip(self.back_staging, (rows, state)))
            copied = self.runtime.recorded()
            self._update_in_flight = (ids, rows, state, copied)
            return
        if rows.device != self.store.device:
            rows, state = self.runtime.to_host(rows), self.runtime.to_host(state)
        self.store.write(ids, rows, state)  # fp32: no rounding key

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        self.flush()
        if self.staging is not None and ids.device.type == "cpu":  # evaluation: pinned, so the copy is asynchronous
            return self._gather(self.store.weights, ids, self.staging[0])
        if ids.device != self.store.device:
            ids = self.runtime.to_device(ids, self.store.device) if ids.device.type == "cpu" else self.runtime.to_host(ids)
        return self.runtime.to_device(self.store.rows.read(ids), self.device)

    def table_state(self, patch_beside: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        self.flush()
        return super().table_state(patch_beside)

    def load_table_state(self, tables: dict[str, dict]) -> None:
        self.flush()
        super().load_table_state(tables)

    def stats(self) -> dict:
        if self.kind == "device":
            return {}
        return {"bytes_to_device": self.bytes_to_device, "bytes_to_host": self.bytes_to_host}
