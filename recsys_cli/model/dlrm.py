"""DLRM (Naumov et al.): bottom MLP, pooled embeddings, interaction, top MLP.

Interactions (`model.interaction`):
  dot  DLRM's pairwise dot products of the bottom output and every pooled
       embedding, next to the bottom output.
  cat  the bottom output and the pooled embeddings, concatenated.
  dcn  DCNv2's low-rank cross network (Wang et al. 2021) over that
       concatenation, as MLPerf's DLRM-DCNv2 and TorchRec's LowRankCrossNet:
       x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l.

Initialisation of the MLPs (`model.init`):
  dlrm   facebookresearch/dlrm's dlrm_s_pytorch: W ~ N(0, sqrt(2 / (fan_in + fan_out))),
         b ~ N(0, sqrt(1 / fan_out)), drawn from a generator seeded with the run's seed.
  torch  nn.Linear's default (kaiming-uniform weights, b ~ U(+-1/sqrt(fan_in))),
         what TorchRec's MLPs (and so MLPerf's DLRM-DCNv2 reference) use.
The cross network is initialised as TorchRec's LowRankCrossNet in both
modes: xavier-normal V and W, zero bias.
"""

from __future__ import annotations

import math
from typing import Callable, Generic, Protocol, TypeVar

import torch
from torch import nn

from recsys_cli.data.batch import Batch
from recsys_cli.model.linear import Linear

INTERACTIONS = ("dot", "cat", "dcn")
INITS = ("dlrm", "torch")
DENSE_PRECISIONS = ("fp32", "bf16")


def mlp(sizes: list[int], final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(Linear(n_in, n_out))
        if i < len(sizes) - 2 or final_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@torch.no_grad()
def init_dlrm_(module: nn.Module, generator: torch.Generator) -> None:
    """dlrm_s_pytorch's initialisation of every nn.Linear in `module`, in
    registration order."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            fan_out, fan_in = layer.weight.shape
            layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=generator)
            if layer.bias is not None:
                layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out), generator=generator)


class PooledEmbeddings(Protocol):
    """What DLRM asks of its embeddings (a module): the training collection
    (embeddings/collection.py) or a loaded model's tables (inference.py)."""

    features: list[str]  # the sparse features, in the order of the pooled rows
    dim: int

    def __call__(self, batch: Batch) -> torch.Tensor:
        """Pooled embeddings [B, F, dim] of the batch's sparse features."""
        ...


E = TypeVar("E", bound=PooledEmbeddings)


class LowRankCrossNet(nn.Module):
    """DCNv2 cross layers with low-rank weights W_l V_l (W_l: [dim, rank],
    V_l: [rank, dim]); the output has the input's width."""

    def __init__(self, dim: int, num_layers: int, rank: int) -> None:
        super().__init__()
        self.V = nn.ModuleList(nn.Linear(dim, rank, bias=False) for _ in range(num_layers))
        self.W = nn.ModuleList(nn.Linear(rank, dim) for _ in range(num_layers))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        for v, w in zip(self.V, self.W):
            assert isinstance(v, nn.Linear) and isinstance(w, nn.Linear)  # a ModuleList's items are Modules to mypy
            nn.init.xavier_normal_(v.weight, generator=generator)
            nn.init.xavier_normal_(w.weight, generator=generator)
            nn.init.zeros_(w.bias)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, w in zip(self.V, self.W):
            x = x0 * w(v(x)) + x
        return x


class DLRM(nn.Module, Generic[E]):
    """Over embeddings of type E: DLRM[EmbeddingBagCollection] trains,
    DLRM[InferenceTables] scores a loaded checkpoint."""

    _tri_flat: torch.Tensor  # interaction=dot: a buffer (register_buffer)

    def __init__(
        self, num_dense: int, embeddings: E, bottom_mlp: list[int], top_mlp: list[int],
        interaction: str = "dot", init: str = "dlrm", dcn_layers: int = 3, dcn_rank: int = 512, seed: int = 0,
        compile: bool = False, dense_precision: str = "fp32",
    ) -> None:
        """compile: training steps run the dense half (MLPs, interaction)
        through torch.compile; dense_precision=bf16: the MLPs run under bf16
        autocast (the interaction and the logits stay fp32). Both opt-in: the
        default path is the exact fp32 one that the tests hold to."""
        super().__init__()
        if interaction not in INTERACTIONS:
            raise ValueError(f"unknown interaction {interaction!r}")
        if init not in INITS:
            raise ValueError(f"unknown init {init!r}")
        if dense_precision not in DENSE_PRECISIONS:
            raise ValueError(f"unknown dense_precision {dense_precision!r}")
        self.dense_precision = dense_precision
        self.compile_steps = compile
        # made on the first training step
        self._compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.embeddings = embeddings
        self.interaction = interaction
        num_sparse, dim = len(embeddings.features), embeddings.dim
        self.bottom = mlp([num_dense, *bottom_mlp], final_relu=True)
        self.cross: LowRankCrossNet | None = None
        if interaction == "dot":
            n = num_sparse + 1
            rows, cols = torch.tril_indices(n, n, offset=-1)  # strictly lower triangle, row by row
            # Positions in the flattened [F+1, F+1] products: index_select on
            # them is 4-9x faster than z[:, rows, cols] forward and backward,
            # and selects (and scatters back) the same values.
            self.register_buffer("_tri_flat", rows * n + cols, persistent=False)
            top_in = bottom_mlp[-1] + n * (n - 1) // 2
        else:
            top_in = bottom_mlp[-1] + num_sparse * dim
            if interaction == "dcn":
                self.cross = LowRankCrossNet(top_in, dcn_layers, dcn_rank)
        self.top = mlp([top_in, *top_mlp], final_relu=False)
        generator = torch.Generator().manual_seed(seed) if init == "dlrm" else None  # torch: the global RNG
        if generator is not None:
            init_dlrm_(self.bottom, generator)
        if self.cross is not None:
            self.cross.reset_parameters(generator)
        if generator is not None:
            init_dlrm_(self.top, generator)

    def interact(self, bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        if self.interaction == "dot":
            t = torch.cat([bottom.unsqueeze(1), pooled], dim=1)  # [B, F+1, D]
            z = torch.bmm(t, t.transpose(1, 2))
            return torch.cat([bottom, z.flatten(1).index_select(1, self._tri_flat)], dim=1)
        x = torch.cat([bottom, pooled.flatten(1)], dim=1)
        return x if self.cross is None else self.cross(x)

    def dense_forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Logits [B] (fp32) from dense features and pooled embeddings [B, F, D]."""
        if self.compile_steps and torch.is_grad_enabled():
            # Training steps only: they have one batch shape, while
            # evaluation's last batch would make the compiler start over.
            if self._compiled is None:
                self._compiled = torch.compile(self._dense_forward, dynamic=False)
            return self._compiled(dense, pooled)
        return self._dense_forward(dense, pooled)

    def _dense_forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        if self.dense_precision == "fp32":
            return self.top(self.interact(self.bottom(dense), pooled)).squeeze(1)
        with torch.autocast(dense.device.type, dtype=torch.bfloat16):
            bottom = self.bottom(dense)
        x = self.interact(bottom.float(), pooled)
        with torch.autocast(dense.device.type, dtype=torch.bfloat16):
            logits = self.top(x)
        return logits.squeeze(1).float()

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.dense_forward(batch.dense, self.embeddings(batch))
