"""RowStore: every row of a group of tables, fused, at one location, in one precision.

Tables are stacked into one flat [rows, dim] store with per-table row
offsets, so one gather serves all features. The store keeps the optimizer
state beside the rows. Reads return fp32; writes take fp32 and store it in
the store's precision (quantizing low-precision stores, see quant.py). A
write names its step: stochastic rounding noise is keyed by (seed, table,
row within the table, step), so it does not depend on how tables are fused
or in which order rows are written.
"""

from __future__ import annotations

import torch

from recsys_cli.embeddings.quant import INIT_STEP, QuantizedRows, RoundingKey, empty_rows

CHUNK_ROWS = 1 << 18  # rows quantized at a time: no full-size fp32 temporary of a huge table


class RowStore:
    def __init__(
        self,
        weights: torch.Tensor,
        state: torch.Tensor,
        precision: str = "fp32",
        rounding: str = "stochastic",
        seed: int = 0,
        table_rows: list[tuple[int, int]] | None = None,
        empty=None,
    ) -> None:
        """weights: fp32 [rows, dim] initial values; state: fp32 [rows, 0|1];
        table_rows: (table number, rows) of the fused tables in order, the
        tables' identity for rounding keys (default: one table numbered 0);
        empty(shape, dtype): allocates the rows (pinned host memory on CUDA
        runs: the one copy of a host table is built in place, never pinned
        by copying)."""
        self.num_rows, self.dim = weights.shape
        self.seed = seed
        self.device = weights.device
        table_rows = table_rows or [(0, self.num_rows)]
        sizes = torch.tensor([n for _, n in table_rows], dtype=torch.int64)
        self._table_start = torch.cumsum(sizes, 0) - sizes
        self._table_number = torch.tensor([t for t, _ in table_rows], dtype=torch.int64)
        self.rows: QuantizedRows = empty_rows(self.num_rows, self.dim, precision, rounding, self.device, empty)
        for start in range(0, self.num_rows, CHUNK_ROWS):
            ids = torch.arange(start, min(self.num_rows, start + CHUNK_ROWS), device=self.device)
            self.rows.write(ids, weights[ids], self.key(ids, INIT_STEP))
        self.state = state

    @property
    def precision(self) -> str:
        return self.rows.precision

    def key(self, ids: torch.Tensor, step: int) -> RoundingKey:
        """The rounding key of writing fused rows `ids` at `step`."""
        ids_cpu = ids.cpu()
        if self._table_start.numel() == 1:
            table = torch.zeros_like(ids_cpu)
        else:
            table = torch.searchsorted(self._table_start, ids_cpu, right=True) - 1
        local = ids_cpu - self._table_start[table]
        return RoundingKey(self.seed, self._table_number[table].to(ids.device), local.to(ids.device), step)

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 rows and optimizer state of `ids`."""
        return self.rows.read(ids), self.state.index_select(0, ids)

    def write(self, ids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, step: int | None = None) -> None:
        """Store fp32 rows (and state) of `ids`; step keys the rounding of a low-precision store."""
        keyed = self.precision != "fp32" and self.rows.rounding == "stochastic"
        if keyed and step is None:
            raise ValueError("a stochastically rounded write needs its step (the rounding key)")
        self.rows.write(ids, rows, self.key(ids, step) if keyed else None)
        if state.numel():
            self.state.index_copy_(0, ids, state)

    def encode(self, ids: torch.Tensor, rows: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        """What write(ids, rows, ..., step) would store, without storing it."""
        return self.rows.encode(rows, self.key(ids, step))

    def nbytes(self) -> int:
        return self.rows.nbytes() + self.state.numel() * self.state.element_size()

