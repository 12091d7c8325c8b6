"""The dense parameters' optimizers: torch.optim's SGD and Adagrad (foreach), bit for bit, without torch.optim.

Why not torch.optim itself: every torch.optim.Optimizer method is wrapped in
dynamo's `disable`, so the first call imports torch._dynamo (and sympy with
it): about 0.9 s of CPU and 65 MB at the start of every training process
and of every rank, a third of a small run's start-up (measured on a 5-step
`recsys train`: 3.0 s with it, 2.1 s without). These two classes do the
same arithmetic, keep the same state and write the same `state_dict`
(torch.optim's format: "state" keyed by parameter index, "param_groups"
with every hyperparameter), so a checkpoint loads either way and
tests/test_dense_optim.py checks each against torch.optim with torch.equal,
state dicts included.

Adagrad on CPU runs foreach's four passes (the squared-gradient sum, its
root, the root plus eps, the step) on pieces small enough (PIECE_ELEMENTS)
that a piece's parameter, gradient, sum and root stay in the cache between
the passes: over the ~16M dense parameters of MLPerf's DLRM-DCNv2 torch's
foreach took 92 ms a step on a 2-core box, 40 % of a batch-256 step, the
pieces about half of that (issue 41, bench/dense_adagrad_bench.py). Other
parameters (CUDA, non-contiguous, not fp32) take foreach's kernels as torch
calls them. `fused=True` (optimizer.dense_kernel=fused) calls torch's fused
kernel instead, as Adagrad(fused=True) does: one pass, 1.7x faster in a
dlrm_v2 step on CPU, but not foreach's bits (it computes
param - grad / std * lr where foreach computes param + (grad * -lr) / std).

Only what the trainer configures is supported: one parameter group, no
weight decay, lr decay, momentum or maximize.
"""

from __future__ import annotations

import abc
import copy
from collections import defaultdict
from typing import Any, Iterable

import torch

# Elements a piece: 1 MiB of each of the 4 fp32 tensors a piece touches
# (parameter, gradient, sum, root), 4 MiB, in the L3 cache, split by torch
# over its compute threads (1 << 15, under torch's grain size, ran each op
# on one thread: 0.45x foreach's speed on 2 threads; bench/dense_adagrad_bench.py).
PIECE_ELEMENTS = 1 << 18


class DenseOptimizer(abc.ABC):
    """What the trainer and a checkpoint need of a torch.optim.Optimizer:
    `param_groups` (the trainer sets "lr" there), `state`, `zero_grad`,
    `step`, and `state_dict`/`load_state_dict` in torch.optim's format."""

    def __init__(self, params: Iterable[torch.nn.Parameter], hyperparameters: dict[str, Any]) -> None:
        group: dict[str, Any] = {"params": list(params), **hyperparameters}
        if not group["params"]:
            raise ValueError("an optimizer needs at least one parameter")
        self.param_groups: list[dict[str, Any]] = [group]
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.param_groups[0]["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()

    @abc.abstractmethod
    def step(self) -> None:
        """One update of every parameter that has a gradient."""

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Optimizer.state_dict's dict: the live state tensors
        (no copies), parameters numbered in group order."""
        index = {id(p): i for i, p in enumerate(self.params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.params)))
        return {"state": {index[id(p)]: s for p, s in self.state.items()}, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch.optim.Optimizer.load_state_dict: the saved
        hyperparameters replace these, tensors move to their parameter's
        device (and floating dtype; "step" stays as saved); ValueError when
        the groups do not match, or when the saved state lacks a tensor this
        optimizer keeps (another optimizer's: SGD's empty state loaded into
        Adagrad failed at the first step with KeyError: 'step')."""
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if len(saved_groups[0]["params"]) != len(self.params):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        by_id = dict(zip(saved_groups[0]["params"], self.params))
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for key, values in state_dict["state"].items():
            if key not in by_id:
                raise ValueError(f"loaded state dict has state for parameter {key!r}, which its group does not list")
            p = by_id[key]
            state[p] = {name: value if name == "step" or not isinstance(value, torch.Tensor) else
                        value.to(device=p.device, dtype=p.dtype if p.is_floating_point() else None)
                        for name, value in values.items()}
        for i, p in enumerate(self.params):
            missing = sorted(set(self.state.get(p, {})) - set(state.get(p, {})))
            if missing:
                raise ValueError(f"loaded state dict has no {missing[0]!r} for parameter {i}: "
                                 f"another optimizer's state")
        saved_groups[0]["params"] = self.params
        self.param_groups, self.state = saved_groups, state

    def _with_grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        return [(p, p.grad) for p in self.params if p.grad is not None]


def _by_device_and_dtype(pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]
                         ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """(parameters, gradients) of each device and dtype: a foreach kernel takes one of each a call."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for p, grad in pairs:
        params, grads = groups.setdefault((p.device, p.dtype), ([], []))
        params.append(p)
        grads.append(grad)
    return list(groups.values())


class DenseSGD(DenseOptimizer):
    """torch.optim.SGD(params, lr, foreach=True): param -= lr * grad."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float) -> None:
        super().__init__(params, dict(lr=lr, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                                      maximize=False, foreach=True, differentiable=False, fused=None))

    @torch.no_grad()
    def step(self) -> None:
        lr = self.param_groups[0]["lr"]
        for params, grads in _by_device_and_dtype(self._with_grads()):
            torch._foreach_add_(params, grads, alpha=-lr)


class DenseAdagrad(DenseOptimizer):
    """torch.optim.Adagrad(params, lr, eps=eps,
    initial_accumulator_value=..., foreach=True): per parameter, "step" (a
    float32 scalar tensor) and "sum" (the squared gradients, from
    initial_accumulator_value); sum += grad * grad,
    param += (grad * -lr) / (sqrt(sum) + eps). A parameter without a
    gradient is skipped, its step count too."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, eps: float,
                 initial_accumulator_value: float, fused: bool = False) -> None:
        self.fused = fused
        flags = self._kernel_flags()  # in torch's order of the keys
        super().__init__(params, dict(lr=lr, lr_decay=0, eps=eps, weight_decay=0,
                                      initial_accumulator_value=initial_accumulator_value, foreach=flags["foreach"],
                                      maximize=False, differentiable=False, fused=flags["fused"]))
        for p in self.params:
            # the fused kernel reads the step count where the parameter is
            self.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
            self.state[p]["sum"] = torch.full_like(p, initial_accumulator_value, memory_format=torch.preserve_format)
        self._root = torch.empty(0)

    def _kernel_flags(self) -> dict[str, bool | None]:
        """The flags torch.optim.Adagrad's param group carries for this kernel."""
        return dict(foreach=None, fused=True) if self.fused else dict(foreach=True, fused=None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved state and rate; the kernel stays this optimizer's (the
        config's), and a fused one's step counts move to their parameters'
        device, as torch's do."""
        super().load_state_dict(state_dict)
        self.param_groups[0].update(self._kernel_flags())
        if self.fused:
            for p, state in self.state.items():
                state["step"] = state["step"].to(dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        if self.fused:
            for params, grads in _by_device_and_dtype(self._with_grads()):
                steps = [self.state[p]["step"] for p in params]
                torch._foreach_add_(steps, 1)
                torch._fused_adagrad_(params, grads, [self.state[p]["sum"] for p in params], steps, lr=group["lr"],
                                      lr_decay=0, weight_decay=0, eps=group["eps"], maximize=False,
                                      grad_scale=None, found_inf=None)
            return
        minus_lr, eps = -float(group["lr"]), group["eps"]
        others = []
        for p, grad in self._with_grads():
            state = self.state[p]
            state["step"] += 1
            if (p.device.type == "cpu" and p.dtype == torch.float32 and not grad.is_sparse
                    and p.is_contiguous() and grad.is_contiguous() and state["sum"].is_contiguous()):
                self._pieces(p.view(-1), grad.view(-1), state["sum"].view(-1), minus_lr, eps)
            else:
                others.append((p, grad))
        for params, grads in _by_device_and_dtype(others):
            sums = [self.state[p]["sum"] for p in params]
            torch._foreach_addcmul_(sums, grads, grads, value=1)
            std = torch._foreach_sqrt(sums)
            torch._foreach_add_(std, eps)
            torch._foreach_addcdiv_(params, torch._foreach_mul(grads, minus_lr), std)

    def _pieces(self, param: torch.Tensor, grad: torch.Tensor, total: torch.Tensor, minus_lr: float,
                eps: float) -> None:
        """foreach's passes, in its order, piece by piece. addcdiv's
        value * t1 / t2 takes the product first, as foreach's separate
        multiply does: the same bits."""
        n, piece = param.numel(), PIECE_ELEMENTS
        if self._root.numel() < min(n, piece):
            self._root = torch.empty(piece)
        for lo in range(0, n, piece):
            hi = min(n, lo + piece)
            g, s = grad[lo:hi], total[lo:hi]
            s.addcmul_(g, g, value=1)
            root = torch.sqrt(s, out=self._root[: hi - lo])
            root.add_(eps)
            param[lo:hi].addcdiv_(g, root, value=minus_lr)
