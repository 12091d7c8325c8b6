"""RowStore: every row of a group of tables, fused, at one location, in one precision.

Tables are stacked into one flat [rows, dim] store with per-table row
offsets, so one gather serves all features. The store keeps the optimizer
state beside the rows. Reads return fp32; writes take fp32 and store it in
the store's precision (quantizing low-precision stores, see quant.py).
"""

from __future__ import annotations

import torch

from recsys_cli.embeddings.quant import QuantizedRows, make_rows


class RowStore:
    def __init__(
        self,
        weights: torch.Tensor,
        state: torch.Tensor,
        precision: str = "fp32",
        rounding: str = "stochastic",
        generator: torch.Generator | None = None,
    ) -> None:
        """weights: fp32 [rows, dim] initial values; state: fp32 [rows, 0|1]."""
        self.num_rows, self.dim = weights.shape
        self.generator = generator  # stochastic rounding; its state is checkpointed
        self.rows: QuantizedRows = make_rows(weights, precision, rounding, generator)
        self.state = state
        self.device = weights.device

    @property
    def precision(self) -> str:
        return self.rows.precision

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 rows and optimizer state of `ids`."""
        return self.rows.read(ids), self.state.index_select(0, ids)

    def write(self, ids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor) -> None:
        self.rows.write(ids, rows)
        if state.numel():
            self.state.index_copy_(0, ids, state)

    def nbytes(self) -> int:
        return self.rows.nbytes() + self.state.numel() * self.state.element_size()

    def pin_memory(self) -> None:
        self.rows.pin_memory()
        self.state = self.state.pin_memory()
