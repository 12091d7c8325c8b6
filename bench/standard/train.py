"""Training throughput: recsys against a plain PyTorch DLRM on the same batches.

Model: DLRM's Criteo Kaggle reference (model=dlrm_kaggle: 16-dim embeddings,
bottom 13-512-256-64-16, top 512-256-1) on synthetic data with Kaggle's
cardinalities (33.8M embedding rows at scale 1), SGD lr 0.1. Systems:
  recsys            the trainer end to end through its loader (reading
                    parquet and planning lookups on a second thread that
                    shares the cores)
  recsys in-memory  the trainer's train_step on batches already loaded
  plain PyTorch     what one writes with plain PyTorch: one nn.EmbeddingBag
                    per table with sparse gradients, nn.Linear MLPs,
                    torch.optim.SGD, on the same in-memory batches
  MLPs only         the plain model without embeddings: the floor for any
                    implementation
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.harness import Benchmark, System, SystemRun
from bench.standard.common import TrainerRun, TrainSize, train_config
from recsys_cli.model.dlrm import mlp
from recsys_cli.train.trainer import Trainer

IN_MEMORY_BATCHES = 300  # batches held for the in-memory systems, cycled


class PlainDLRM(nn.Module):
    def __init__(self, vocab_sizes: Sequence[int], dim: int = 16, with_embeddings: bool = True) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in vocab_sizes) \
            if with_embeddings else None
        self.bottom = mlp([13, 512, 256, 64, dim], final_relu=True)
        n = len(vocab_sizes) + 1
        self.rows, self.cols = torch.tril_indices(n, n, offset=-1)
        self.top = mlp([dim + n * (n - 1) // 2, 512, 256, 1], final_relu=False)

    def forward(self, dense: torch.Tensor, per_table: Any) -> torch.Tensor:
        x = self.bottom(dense)
        if self.tables is None:
            pooled = per_table  # [B, F, D] stand-in
        else:
            pooled = torch.stack([t(v, o) for t, (v, o) in zip(self.tables, per_table)], dim=1)
        t = torch.cat([x.unsqueeze(1), pooled], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.rows, self.cols]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


def split_tables(batch: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A batch's jagged features as (values, offsets) per table."""
    kjt = batch.sparse
    offsets = kjt.offsets()
    out = []
    for f in range(len(kjt.keys)):
        lo, hi = f * kjt.stride, (f + 1) * kjt.stride
        start = offsets[lo]
        out.append((kjt.values[start:offsets[hi]], offsets[lo:hi] - start))
    return out


def loaded_batches(trainer: Trainer, count: int) -> list[Any]:
    batches = []
    for b in trainer.train_loader:
        batches.append(b)
        if len(batches) == count:
            break
    return batches


class InMemoryRecsys(SystemRun):
    def __init__(self, size: TrainSize) -> None:
        self.trainer = Trainer(train_config(size))
        self.batches = loaded_batches(self.trainer, min(size.total_steps(), IN_MEMORY_BATCHES))
        self.steps, self.next = size.steps, 0

    def chunk(self) -> int:
        samples = 0
        for _ in range(self.steps):
            batch = self.batches[self.next % len(self.batches)]
            self.next += 1
            self.trainer.train_step(batch)
            samples += batch.size
        return samples


class Plain(SystemRun):
    def __init__(self, size: TrainSize, with_embeddings: bool = True) -> None:
        trainer = Trainer(train_config(size))  # its loader: the same batches recsys trains on
        batches = loaded_batches(trainer, min(size.total_steps(), IN_MEMORY_BATCHES))
        vocab = [f.vocab_size for f in trainer.data.manifest.sparse_features]
        del trainer
        torch.manual_seed(0)
        self.model = PlainDLRM(vocab, with_embeddings=with_embeddings)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.inputs = [(b.dense, split_tables(b) if with_embeddings else torch.randn(b.size, len(vocab), 16), b.labels)
                       for b in batches]
        self.steps, self.next = size.steps, 0

    def chunk(self) -> int:
        samples = 0
        for _ in range(self.steps):
            dense, sparse, labels = self.inputs[self.next % len(self.inputs)]
            self.next += 1
            loss = F.binary_cross_entropy_with_logits(self.model(dense, sparse), labels)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            samples += len(labels)
        return samples


BENCHMARK = Benchmark[TrainSize](
    name="train",
    section="Training throughput: recsys vs plain PyTorch (dlrm_kaggle, Kaggle cardinalities, CPU)",
    note="Same batches, same model, SGD lr 0.1. Goal: >= 1.5x the plain reference at batch 128.",
    sizes={
        "smoke": TrainSize(rows=4_000, scale=0.001, batch=128, steps=3, rounds=2),
        "standard": TrainSize(rows=300_000, scale=1.0, batch=128, steps=100, rounds=5),
        "batch2048": TrainSize(rows=300_000, scale=1.0, batch=2048, steps=10, rounds=5),
    },
    systems=[
        System("plain PyTorch", Plain),  # the baseline: the ratios are recsys / plain
        System("recsys", lambda size: TrainerRun(train_config(size), size.steps)),
        System("recsys in-memory", InMemoryRecsys),
        System("MLPs only", lambda size: Plain(size, with_embeddings=False)),
    ],
    seconds=80,
)
