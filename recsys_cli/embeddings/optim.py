"""Row optimizers: the update rule for embedding rows.

An embedding row is updated only when a batch touches it, and its optimizer
state (row-wise Adagrad's one accumulator) travels with it between table and
cache. The rule is a pure function of (rows, state, grad) so that every
placement applies exactly the same arithmetic to the same values: that is
what makes cached training bit-for-bit equal to training on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowOptimizer:
    name: str = "sgd"  # sgd | adagrad (row-wise)
    # The current step's rate: with a learning-rate schedule the trainer sets
    # it before every step (train/schedule.py); every group shares this object.
    lr: float = 0.1
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    @property
    def has_state(self) -> bool:
        return self.name == "adagrad"

    def initial_state(self, num_rows: int, device: torch.device | str = "cpu", empty=None) -> torch.Tensor:
        """One fp32 accumulator per row for Adagrad, an empty column for SGD;
        empty(shape, dtype) allocates it (pinned host memory)."""
        width = 1 if self.has_state else 0
        if empty is not None:
            return empty((num_rows, width), torch.float32).fill_(self.initial_accumulator)
        return torch.full((num_rows, width), self.initial_accumulator, dtype=torch.float32, device=device)

    def step(self, rows: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return updated (rows, state) for rows [n, D], state [n, 0|1], grad [n, D]."""
        if self.name == "sgd":
            return rows - self.lr * grad, state
        # Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): the accumulator
        # grows by the mean squared gradient of the row.
        state = state + rowwise_sum(grad.square()) / grad.shape[1]
        return rows - self.lr * grad / (state.sqrt() + self.eps), state


def rowwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 as a fixed pairwise tree of elementwise adds, [n, D] -> [n, 1].

    torch's reduction kernels pick their summation order from the tensor's
    shape, so the same row summed inside batches of different sizes (one
    fused group vs several) can differ in the last bit. Elementwise adds do
    not: every row is summed in the same order whatever n is.
    """
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        folded = x[:, :half] + x[:, half : 2 * half]
        x = torch.cat([folded, x[:, 2 * half :]], dim=1) if x.shape[1] % 2 else folded
    return x
