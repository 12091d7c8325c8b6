"""samples/s of recsys's trainer against a plain PyTorch DLRM on the same batches.

    .venv/bin/python -m bench.train_bench [--rows 300000] [--steps 300]

Model: DLRM's Criteo Kaggle reference (model=dlrm_kaggle: 16-dim embeddings,
bottom 13-512-256-64-16, top 512-256-1) on synthetic data with Kaggle's
cardinalities (33.8M embedding rows), SGD lr 0.1. The reference is what one
writes with plain PyTorch: one nn.EmbeddingBag per table with sparse
gradients, nn.Linear MLPs, torch.optim.SGD; it trains on batches already in
memory (its data loading is not timed). recsys is timed twice: end to end
through its loader (reading parquet and planning lookups on a second thread
that shares the two cores), and on the same in-memory batches as the
reference. "MLPs only" is the reference without embeddings: the floor for
any implementation.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from recsys_cli.config import TrainConfig
from recsys_cli.model.dlrm import mlp
from recsys_cli.train.trainer import Trainer


class PlainDLRM(nn.Module):
    def __init__(self, vocab_sizes: list[int], dim: int = 16, with_embeddings: bool = True) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in vocab_sizes) \
            if with_embeddings else None
        self.num_sparse, self.dim = len(vocab_sizes), dim
        self.bottom = mlp([13, 512, 256, 64, dim], final_relu=True)
        n = self.num_sparse + 1
        self.rows, self.cols = torch.tril_indices(n, n, offset=-1)
        self.top = mlp([dim + n * (n - 1) // 2, 512, 256, 1], final_relu=False)

    def forward(self, dense, per_table) -> torch.Tensor:
        x = self.bottom(dense)
        if self.tables is None:
            pooled = per_table  # [B, F, D] stand-in
        else:
            pooled = torch.stack([t(v, o) for t, (v, o) in zip(self.tables, per_table)], dim=1)
        t = torch.cat([x.unsqueeze(1), pooled], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.rows, self.cols]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


def split_tables(batch):
    kjt = batch.sparse
    offsets = kjt.offsets()
    out = []
    for f in range(len(kjt.keys)):
        lo, hi = f * kjt.stride, (f + 1) * kjt.stride
        start = offsets[lo]
        out.append((kjt.values[start : offsets[hi]], offsets[lo:hi] - start))
    return out


def time_reference(batches, vocab_sizes, with_embeddings=True) -> float:
    torch.manual_seed(0)
    model = PlainDLRM(vocab_sizes, with_embeddings=with_embeddings)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = [(b.dense, split_tables(b) if with_embeddings else torch.randn(b.size, len(vocab_sizes), 16), b.labels)
              for b in batches]
    for dense, sparse, labels in inputs[:5]:  # warm-up
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    start = time.perf_counter()
    for dense, sparse, labels in inputs:
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return sum(b.size for b in batches) / (time.perf_counter() - start)


def recsys_config(rows: int, batch_size: int, steps: int, placement: dict | None = None) -> TrainConfig:
    cfg = OmegaConf.structured(TrainConfig)
    OmegaConf.update(cfg, "model", OmegaConf.load("configs/model/dlrm_kaggle.yaml"), merge=True)
    cfg.dataset.synthetic.rows = rows
    cfg.dataset.synthetic.cardinality_scale = 1.0
    cfg.trainer.batch_size = batch_size
    cfg.trainer.max_steps = steps
    cfg.trainer.progress = False
    cfg.trainer.log_every = 10_000
    cfg.trainer.threads = torch.get_num_threads()  # the plain reference's count (torch's default): like for like
    if placement:
        OmegaConf.update(cfg, "placement", placement, merge=True)
    return cfg


def time_recsys(cfg) -> tuple[float, dict]:
    trainer = Trainer(cfg)
    trainer.eval_loaders = {}  # throughput only
    summary = trainer.fit()
    return summary["samples_per_second"], summary


def time_recsys_in_memory(trainer: Trainer, batches) -> float:
    """recsys's train_step on batches already loaded and planned: the same
    footing as the plain reference."""
    for b in batches[:5]:
        trainer.train_step(b)
    start = time.perf_counter()
    for b in batches:
        trainer.train_step(b)
    return sum(b.size for b in batches) / (time.perf_counter() - start)


def run(rows: int = 300_000, steps128: int = 600, steps2048: int = 60) -> list[dict]:
    results = []
    for batch_size, steps in ((128, steps128), (2048, steps2048)):
        cfg = recsys_config(rows, batch_size, steps)
        ours, summary = time_recsys(cfg)
        trainer = Trainer(cfg)
        batches = []
        for b in trainer.train_loader:
            batches.append(b)
            if len(batches) == min(steps, 300):
                break
        vocab = [f.vocab_size for f in trainer.data.manifest.sparse_features]
        in_memory = time_recsys_in_memory(trainer, batches)
        del trainer
        reference = time_reference(batches, vocab)
        mlps = time_reference(batches, vocab, with_embeddings=False)
        row = {"batch": batch_size, "recsys samples/s": ours, "recsys in-memory samples/s": in_memory,
               "plain PyTorch samples/s": reference, "MLPs only samples/s": mlps,
               "recsys / plain": ours / reference, "in-memory / plain": in_memory / reference}
        print(row, flush=True)
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    rows = run(args.rows, args.steps)
    if args.record:
        from bench.record import record

        record("Training throughput: recsys vs plain PyTorch (dlrm_kaggle, Kaggle cardinalities, CPU)",
               list(rows[0]), rows, f"python -m bench.train_bench --rows {args.rows} --steps {args.steps}",
               note="Same batches, same model, SGD lr 0.1. Goal: >= 1.5x the plain reference at batch 128.")


if __name__ == "__main__":
    main()
