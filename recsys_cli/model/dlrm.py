"""DLRM (Naumov et al.): bottom MLP, pooled embeddings, interaction, top MLP."""

from __future__ import annotations

import torch
from torch import nn

from recsys_cli.data.batch import Batch
from recsys_cli.embeddings.collection import EmbeddingCollection


def mlp(sizes: list[int], final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2 or final_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(
        self, num_dense: int, embeddings: EmbeddingCollection, bottom_mlp: list[int], top_mlp: list[int],
        interaction: str = "dot",
    ) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.interaction = interaction
        num_sparse, dim = len(embeddings.features), embeddings.dim
        self.bottom = mlp([num_dense, *bottom_mlp], final_relu=True)
        if interaction == "dot":
            # Pairwise dot products of the bottom output and every pooled
            # embedding (strictly lower triangle), next to the bottom output.
            n = num_sparse + 1
            rows, cols = torch.tril_indices(n, n, offset=-1)
            self.register_buffer("_tri_rows", rows, persistent=False)
            self.register_buffer("_tri_cols", cols, persistent=False)
            top_in = bottom_mlp[-1] + n * (n - 1) // 2
        elif interaction == "cat":
            top_in = bottom_mlp[-1] + num_sparse * dim
        else:
            raise ValueError(f"unknown interaction {interaction!r}")
        self.top = mlp([top_in, *top_mlp], final_relu=False)

    def interact(self, bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        if self.interaction == "cat":
            return torch.cat([bottom, pooled.flatten(1)], dim=1)
        t = torch.cat([bottom.unsqueeze(1), pooled], dim=1)  # [B, F+1, D]
        z = torch.bmm(t, t.transpose(1, 2))
        return torch.cat([bottom, z[:, self._tri_rows, self._tri_cols]], dim=1)

    def dense_forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Logits [B] from dense features and pooled embeddings [B, F, D]."""
        return self.top(self.interact(self.bottom(dense), pooled)).squeeze(1)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.dense_forward(batch.dense, self.embeddings(batch))
