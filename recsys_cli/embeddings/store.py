"""RowStore: every row of a group of tables, fused, at one location, in one precision.

Tables are stacked into one flat [rows, dim] store with per-table row
offsets, so one gather serves all features. The store keeps the optimizer
state beside the rows. Reads return fp32; writes take fp32 and store it in
the store's precision (quantizing low-precision stores, see quant.py). A
write names its step: stochastic rounding noise is keyed by (seed, table,
row within the table, step), so it does not depend on how tables are fused
or in which order rows are written.

A store is allocated once, in its precision and location, and built in place
(table_init.build_initial_rows -> write_initial, chunk by chunk): no fp32 copy of
a low-precision table and no concatenation of the tables ever exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from recsys_cli.device import with_index
from recsys_cli.embeddings.quant import INIT_STEP, FP32Rows, QuantizedRows, RoundingKey, decode_saved, empty_rows

if TYPE_CHECKING:
    from recsys_cli.embeddings.protocols import RowStoreProtocol


class RowStore:
    def __init__(
        self,
        num_rows: int,
        dim: int,
        state: torch.Tensor,
        precision: str = "fp32",
        rounding: str = "stochastic",
        seed: int = 0,
        table_rows: list[tuple[int, ...]] | None = None,
        empty=None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Uninitialised rows [num_rows, dim] in `precision` on `device` (fill
        them with write_initial, e.g. through table_init.build_initial_rows);
        state: fp32 [rows, 0|1]; table_rows: (table number, rows) of the fused
        tables in order, the tables' identity for rounding keys (default: one
        table numbered 0), with a shard's first row of its table as a third
        value (its rows are keyed as the whole table's); empty(shape, dtype): allocates the rows (pinned host
        memory on CUDA runs: the one copy of a host table is built in place,
        never pinned by copying)."""
        self.num_rows, self.dim = num_rows, dim
        self.seed = seed
        self.device = with_index(device)
        table_rows = table_rows or [(0, self.num_rows)]
        sizes = torch.tensor([t[1] for t in table_rows], dtype=torch.int64)
        self._table_start = torch.cumsum(sizes, 0) - sizes
        self._table_number = torch.tensor([t[0] for t in table_rows], dtype=torch.int64)
        # a key's row: the row of the whole table (a shard's rows start at its first row)
        self._table_base = self._table_start - torch.tensor([t[2] if len(t) > 2 else 0 for t in table_rows])
        self.rows: QuantizedRows = empty_rows(self.num_rows, self.dim, precision, rounding, self.device, empty)
        self.state = state
        self.mapped = False  # host memory the device addresses directly (map_to_device)

    def map_to_device(self, device_view, device: torch.device) -> bool:
        """placement=uvm: the rows and their optimizer state stay in host memory,
        and from now on the store's tensors are device views of it
        (device_view: Runtime.device_view), so every read and write is a kernel
        over the host pages, with no copy. False, changing nothing, where
        there is no such view (CPU: the store stays a host store)."""
        if not isinstance(self.rows, FP32Rows):
            return False
        weights, state = device_view(self.rows.weights), device_view(self.state)
        if weights is None or state is None:
            return False
        self.rows.weights, self.state, self.device, self.mapped = weights, state, with_index(device), True
        return True

    def write_initial(self, start: int, rows: torch.Tensor) -> None:
        """Store the initial fp32 rows of fused rows [start, start + n): each
        row is rounded on its own, keyed by (table, row, INIT_STEP), so the
        bits do not depend on how the build is chunked."""
        ids = torch.arange(start, start + rows.shape[0], device=self.device)
        self.rows.write(ids, rows.to(self.device), self.key(ids, INIT_STEP) if self._keyed else None)

    def initial_view(self, start: int, end: int) -> torch.Tensor | None:
        """The fp32 host rows [start, end) to initialise in place, else None."""
        if isinstance(self.rows, FP32Rows) and self.device.type == "cpu":
            return self.rows.weights[start:end]
        return None

    @property
    def weights(self) -> torch.Tensor:
        """An fp32 store's rows tensor (a table in memory: its step reads it directly)."""
        if not isinstance(self.rows, FP32Rows):
            raise TypeError(f"a {self.precision} store has no fp32 weights tensor")
        return self.rows.weights

    @property
    def _keyed(self) -> bool:
        return self.precision != "fp32" and self.rows.rounding == "stochastic"

    @property
    def precision(self) -> str:
        return self.rows.precision

    def key(self, ids: torch.Tensor, step: int) -> RoundingKey:
        """The rounding key of writing fused rows `ids` at `step`, computed
        where `ids` are: a device-resident store's writes never copy ids to the
        host (a device sync every write)."""
        tables_on = self.__dict__.setdefault("_tables_on", {})  # per device (a DiskRowStore has its own __init__)
        if ids.device not in tables_on:
            tables_on[ids.device] = (self._table_start.to(ids.device), self._table_number.to(ids.device),
                                     self._table_base.to(ids.device))
        starts, numbers, bases = tables_on[ids.device]
        if starts.numel() == 1:
            table = torch.zeros_like(ids)
        else:
            table = torch.searchsorted(starts, ids, right=True) - 1
        return RoundingKey(self.seed, numbers[table], ids - bases[table], step)

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 rows and optimizer state of `ids`."""
        return self.rows.read(ids), self.state.index_select(0, ids)

    def write(self, ids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, step: int | None = None) -> None:
        """Store fp32 rows (and state) of `ids`; step keys the rounding of a low-precision store."""
        key = None
        if self._keyed:
            if step is None:
                raise ValueError("a stochastically rounded write needs its step (the rounding key)")
            key = self.key(ids, step)
        self.rows.write(ids, rows, key)
        if state.numel():
            self.state.index_copy_(0, ids, state)

    def encode(self, ids: torch.Tensor, rows: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        """What write(ids, rows, ..., step) would store, without storing it."""
        return self.rows.encode(rows, self.key(ids, step))

    def nbytes(self) -> int:
        return self.rows.nbytes() + self.state.numel() * self.state.element_size()

    # --- the rest of the store protocol: what a cache and a checkpoint use -----
    # (the disk store, disk_store.py, implements the same methods over files)
    @property
    def state_width(self) -> int:
        """fp32 optimizer values per row (0: SGD, 1: row-wise Adagrad)."""
        return self.state.shape[1]

    def read_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows of `ids`, without their state."""
        return self.rows.read(ids)

    def read_state(self, ids: torch.Tensor) -> torch.Tensor:
        return self.state.index_select(0, ids)

    def memory(self, tier: str) -> list[tuple[str, str, int]]:
        """(tier, what, bytes) of each tensor the store allocates (TableGroup.memory):
        one entry per allocation, as the CUDA allocator counts blocks."""
        tensors = [*self.rows.tensors().values(), self.state]
        return [(tier, "table", t.numel() * t.element_size()) for t in tensors]

    def stats(self) -> dict:
        return {}

    def table_snapshot(self, spec, lo: int, hi: int, patch=None) -> dict:
        """Table `spec` (fused rows [lo, hi)) for a checkpoint, in native tensors:
        views of the store (torch.save writes their shared storage once, so a
        checkpoint of large host tables does not double host memory), and
        beside them, never copied into them, the "patch" of rows that live in
        a cache (`patch` is the function that gives their local ids, encoded
        rows and state): readers put it in (quant.patched_entry, through
        load_checkpoint or materialize), so a checkpoint's memory is the
        cache's dirty rows, not a copy of the table."""
        entry = {"precision": self.precision, **{k: v[lo:hi].cpu() for k, v in self.rows.tensors().items()}}
        entry["state"] = self.state[lo:hi].cpu()
        patch = patch() if patch is not None else None
        if patch is not None:
            local, encoded, state = patch
            entry["patch"] = {"rows": local.cpu(), **{k: v.cpu() for k, v in encoded.items()}, "state": state.cpu()}
        return entry

    def load_table(self, spec, lo: int, hi: int, saved: dict) -> None:
        """Load what table_snapshot wrote, from any placement (a disk checkpoint
        is read whole); a table saved in another precision is converted through fp32."""
        from recsys_cli.embeddings.disk_checkpoint import materialize
        from recsys_cli.embeddings.quant import CONVERT_STEP

        saved = materialize(saved)
        if saved["precision"] == self.precision:
            for k, v in self.rows.tensors().items():
                v[lo:hi] = saved[k].to(v.device)
        else:
            ids = torch.arange(lo, hi, device=self.device)
            self.rows.write(ids, decode_saved(saved, spec.dim).to(self.device), self.key(ids, CONVERT_STEP))
        state = saved["state"].to(self.device)
        if state.shape[1] == self.state.shape[1]:
            self.state[lo:hi] = state


if TYPE_CHECKING:  # mypy: a RowStore is what protocols.RowStoreProtocol promises

    def _is_a_row_store(store: RowStore) -> RowStoreProtocol:
        return store
