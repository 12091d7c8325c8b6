"""The dense parameters' Adagrad on CPU: torch's foreach arithmetic, one cache-sized piece at a time.

torch.optim.Adagrad(foreach=True) makes four passes over every parameter
(the squared-gradient sum, its root, the root plus eps, the step), each
one reading and writing the whole parameter from memory: over the ~16M
dense parameters of MLPerf's DLRM-DCNv2 that was 92 ms a step on this
2-core box, 40 % of a batch-256 step (issue 41). `ChunkedAdagrad` runs the
same elementwise kernels, in the same order, on pieces small enough
(PIECE_ELEMENTS) that a piece's parameter, gradient, sum and root stay in
the cache between the passes: the same bits (tests/test_dense_adagrad.py
checks torch.equal against torch.optim.Adagrad(foreach=True)), about half
the memory traffic.

torch's fused CPU kernel (Adagrad(fused=True), one pass) is faster still
but not bit-equal: it computes param - grad / std * lr where foreach
computes param + (grad * -lr) / std, a different rounding of the same
update, so every Adagrad run would change; this class keeps them.

The state is torch.optim.Adagrad's own ("sum", "step" per parameter), so
checkpoints are unchanged and load either way. What the pieces do not
cover (CUDA tensors, weight decay, lr decay, maximize, sparse or
non-contiguous gradients) takes torch's foreach path.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

# Elements a piece: 1 MiB of each of the 4 fp32 tensors a piece touches
# (parameter, gradient, sum, root), 4 MiB, in the L3 cache, split by torch
# over its compute threads (1 << 15, under torch's grain size, ran each op
# on one thread: 0.45x foreach's speed on 2 threads; bench/dense_adagrad_bench.py).
PIECE_ELEMENTS = 1 << 18


class ChunkedAdagrad(torch.optim.Adagrad):
    """torch.optim.Adagrad(foreach=True), bit for bit, piece by piece on CPU."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, eps: float,
                 initial_accumulator_value: float) -> None:
        super().__init__(params, lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value, foreach=True)
        self._root = torch.empty(0)

    def _pieces_apply(self, group: dict[str, Any]) -> bool:
        return (group["weight_decay"] == 0 and group["lr_decay"] == 0 and not group["maximize"]
                and not group.get("differentiable", False))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        done, others = [], []
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if (not self._pieces_apply(group) or p.device.type != "cpu" or grad.is_sparse
                        or not (p.is_contiguous() and grad.is_contiguous()) or p.dtype != torch.float32):
                    others.append(p)
                    continue
                state = self.state[p]
                state["step"] += 1
                # foreach's numerator is grad * -clr, clr = lr / (1 + (step - 1) * lr_decay) = lr (lr_decay 0)
                self._update(p.view(-1), grad.view(-1), state["sum"].view(-1), -float(group["lr"]), group["eps"])
                done.append(p)
        if others:  # torch's own path for these: the updated parameters hidden from it (it skips grad None)
            grads = [p.grad for p in done]
            try:
                for p in done:
                    p.grad = None
                super().step()
            finally:
                for p, g in zip(done, grads):
                    p.grad = g
        return loss

    def _update(self, param: torch.Tensor, grad: torch.Tensor, total: torch.Tensor, minus_clr: float,
                eps: float) -> None:
        """foreach Adagrad's four ops, in its order, on each piece:
        sum += grad * grad; std = sqrt(sum) + eps; param += (grad * -clr) / std
        (addcdiv's value * t1 / t2: the product first, as foreach's separate multiply)."""
        n, piece = param.numel(), PIECE_ELEMENTS
        if self._root.numel() < min(n, piece):
            self._root = torch.empty(piece)
        for lo in range(0, n, piece):
            hi = min(n, lo + piece)
            g, s = grad[lo:hi], total[lo:hi]
            s.addcmul_(g, g, value=1)
            root = torch.sqrt(s, out=self._root[: hi - lo])
            root.add_(eps)
            param[lo:hi].addcdiv_(g, root, value=minus_clr)
