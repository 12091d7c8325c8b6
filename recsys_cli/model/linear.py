"""Linear: nn.Linear with a backward that picks the faster of two equal GEMM layouts.

A layer's backward is two matrix products, grad_input = g @ W and
grad_weight = g^T @ x. When in_features is not a multiple of 16 (DLRM's
dense input of 13, the dot interaction's 16 + 351 = 367), both products
write rows of that odd width, and MKL's single-thread sgemm runs them well
below its peak (1.5x slower at batch 2048 for 367 -> 512). The transposed
products (W^T g^T)^T and (x^T g)^T write along the wide dimension instead,
and are the same dot products summed in the same order: the gradients are
bit for bit those of nn.Linear (tests/test_model_speed.py checks it with
torch.equal on the models' shapes, batches of 1 to 2048), only faster. That
holds for one compute thread (the trainer's default on two cores): with more,
MKL splits the reduction differently in the two layouts and the last bits
differ (seen at batch 2048), so with more threads nn.Linear's backward runs.

The module is an nn.Linear (same parameters, state_dict keys and
initialisation), so checkpoints and every isinstance(nn.Linear) keep working.
"""

from __future__ import annotations

import torch
from torch import nn

_ALIGN = 16  # fp32 values per 64-byte cache line
# Below this many rows MKL takes a small-matrix path for one of the two
# layouts and the sums can differ in the last bit (seen for 2-11 rows);
# from 12 rows up they are equal on every shape tried, up to 4096 rows.
MIN_ROWS = 16


def transposed_backward(in_features: int, out_features: int) -> bool:
    """Whether the backward products of a layer this shape are computed transposed."""
    return in_features % _ALIGN != 0 and out_features % _ALIGN == 0


class _TransposedBackward(torch.autograd.Function):
    """x @ weight^T + bias, whose backward computes both products transposed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.addmm(bias, x, weight.t()) if bias is not None else x.mm(weight.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # (W^T g^T)^T = g W, made contiguous: the interaction's backward
            # (index_add_, cat) takes a slow strided path on the transposed view.
            grad_x = weight.t().mm(grad.t()).t().contiguous()
        if ctx.needs_input_grad[1]:
            grad_weight = x.t().mm(grad).t().contiguous()  # (x^T g)^T = g^T x, in the weight's layout
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)  # what autograd's broadcast of the bias sums (sum_to_size)
        return grad_x, grad_weight, grad_bias


class Linear(nn.Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transposed = transposed_backward(self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only training steps on [batch >= MIN_ROWS, features] inputs on CPU
        # (MKL) with one compute thread outside autocast take the custom backward; everything else
        # (evaluation, export, CUDA, small batches, layers of aligned width,
        # where the usual layout is as fast) is nn.Linear's own.
        if (self.transposed and torch.is_grad_enabled() and x.dim() == 2 and x.shape[0] >= MIN_ROWS
                and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu") and torch.get_num_threads() == 1):
            return _TransposedBackward.apply(x, self.weight, self.bias)
        return super().forward(x)
