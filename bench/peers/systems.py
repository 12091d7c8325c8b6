"""One DLRM, four implementations, each stepping on the project's loader batches.

    recsys   the project's Trainer.train_step (lookup plans made on the loader thread)
    tbe      FBGEMM's SplitTableBatchedEmbeddingBagsCodegen on CPU (every table
             in one TBE, the row optimizer fused into its backward) under
             TorchRec's DenseArch / InteractionArch / OverArch
    plain    one nn.EmbeddingBag per table with sparse gradients, nn.Linear MLPs:
             what one writes with PyTorch alone
    mlps     recsys's dense layers on fixed pooled embeddings: the ceiling that
             no embedding implementation can pass

Same model (dlrm_kaggle's sizes, dot interaction), same initial values (the
peers copy recsys's dense weights and table rows when a recsys system is
built in the same process) and same optimizer: SGD everywhere, or Adagrad
for dense parameters with row-wise Adagrad for rows (FBGEMM's
EXACT_ROWWISE_ADAGRAD, written out for plain PyTorch). Every system reads
the same batches from its own ShardLoader (same seed, so the same order),
and may prepare its inputs on the loader thread (`transform`), as recsys
plans its lookups there.

fbgemm_gpu and torchrec are imported only by the TBE system: the rest runs
in the project's venv too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from bench.standard.train import split_tables
from recsys_cli.config import TrainConfig
from recsys_cli.data.batch import Batch
from recsys_cli.data.loader import ShardLoader

SYSTEMS = ("recsys", "tbe", "plain", "mlps")


@dataclass
class PeerBatch:
    """A loader batch with a peer's inputs, prepared on the loader thread."""

    batch: Batch
    inputs: Any


@dataclass
class Setup:
    """What every system shares: data, model sizes, optimizer."""

    rows: int = 300_000  # synthetic training data
    cardinality_scale: float = 1.0  # 1.0: Criteo Kaggle's vocabularies (33.8M rows)
    batch_size: int = 128
    optimizer: str = "sgd"  # sgd | adagrad
    lr: float = 0.1
    eps: float = 1e-8
    seed: int = 0
    model: str = "configs/model/dlrm_kaggle.yaml"
    overrides: tuple[str, ...] = ()  # recsys config overrides (key=value), e.g. model.compile=true

    def config(self):
        cfg = OmegaConf.structured(TrainConfig)
        OmegaConf.update(cfg, "model", OmegaConf.load(self.model), merge=True)
        cfg.dataset.synthetic.rows = self.rows
        cfg.dataset.synthetic.cardinality_scale = self.cardinality_scale
        cfg.trainer.batch_size = self.batch_size
        cfg.trainer.max_steps = None
        cfg.trainer.progress = False
        cfg.trainer.log_every = 10**9
        cfg.trainer.checkpoint_every = None
        cfg.trainer.seed = self.seed
        cfg.optimizer.name = self.optimizer
        cfg.optimizer.lr = self.lr
        cfg.optimizer.eps = self.eps
        cfg.optimizer.initial_accumulator = 0.0
        for item in self.overrides:
            key, value = item.split("=", 1)
            OmegaConf.update(cfg, key, _parse(value), merge=True)
        return cfg


def _parse(value: str):
    """A command-line value as YAML reads it (true, 3, 0.5, text)."""
    return OmegaConf.create(f"v: {value}").v


@dataclass
class Shapes:
    features: list[str]
    vocab_sizes: list[int]
    dim: int
    num_dense: int
    bottom: list[int]
    top: list[int]


def shapes_of(cfg, dataset_dir: Path) -> Shapes:
    from data_tools.manifest import load_manifest

    m = load_manifest(dataset_dir)
    return Shapes(m.feature_names, [f.vocab_size for f in m.sparse_features], cfg.model.embedding_dim,
                  len(m.dense_features), list(cfg.model.bottom_mlp), list(cfg.model.top_mlp))


def dataset_dir(cfg) -> Path:
    from recsys_cli.train.training_data import resolve_dataset

    return resolve_dataset(cfg.dataset)


def linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


class System:
    name = "base"

    def __init__(self, setup: Setup, shapes: Shapes, data: Path) -> None:
        self.setup, self.shapes, self.data = setup, shapes, data

    def transform(self, batch: Batch):
        """Input preparation on the loader thread."""
        return batch

    def loader(self) -> ShardLoader:
        return ShardLoader(self.data, "train", self.setup.batch_size, shuffle=True, seed=self.setup.seed,
                           drop_last=True, transform=self.transform)

    def step(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError


# --- recsys ------------------------------------------------------------------
class Recsys(System):
    name = "recsys"

    def __init__(self, setup, shapes, data, cfg) -> None:
        super().__init__(setup, shapes, data)
        from recsys_cli.train.trainer import Trainer

        self.trainer = Trainer(cfg)

    def loader(self) -> ShardLoader:
        return self.trainer.train_loader  # plans lookups on its thread

    def step(self, batch: Batch) -> torch.Tensor:
        return self.trainer.train_step(batch)

    # Initial values for the peers: (weight, bias) of every dense layer in
    # order (bottom, top) and every feature's table rows.
    def dense_layers(self) -> list[nn.Linear]:
        return linears(self.trainer.model.bottom) + linears(self.trainer.model.top)

    def tables(self) -> list[torch.Tensor]:
        state = self.trainer.embeddings.table_state()
        return [state[f]["weights"] for f in self.shapes.features]


def copy_dense(dst: list[nn.Linear], src: list[nn.Linear]) -> None:
    """Load recsys's dense weights, layer by layer in order."""
    if len(dst) != len(src):
        raise ValueError(f"{len(dst)} dense layers, recsys has {len(src)}")
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.weight.copy_(s.weight)
            d.bias.copy_(s.bias)


def reorder_top_input(layer: nn.Linear, order: torch.Tensor) -> None:
    """layer's input columns taken from positions `order` of recsys's."""
    with torch.no_grad():
        layer.weight.copy_(layer.weight[:, order])


def tril_position(n: int) -> dict[tuple[int, int], int]:
    """recsys's interaction column of pair (i, j), i > j (strictly lower triangle, row-major)."""
    rows, cols = torch.tril_indices(n, n, offset=-1)
    return {(int(i), int(j)): k for k, (i, j) in enumerate(zip(rows, cols))}


def dense_optimizer(setup: Setup, params) -> torch.optim.Optimizer:
    if setup.optimizer == "sgd":
        return torch.optim.SGD(params, lr=setup.lr)
    return torch.optim.Adagrad(params, lr=setup.lr, eps=setup.eps, initial_accumulator_value=0.0)


def bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels)


# --- FBGEMM TBE + TorchRec dense arch -----------------------------------------
class TBE(System):
    name = "tbe"

    def __init__(self, setup, shapes, data, init: Recsys | None = None) -> None:
        super().__init__(setup, shapes, data)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
        from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

        s = shapes
        optim = EmbOptimType.EXACT_SGD if setup.optimizer == "sgd" else EmbOptimType.EXACT_ROWWISE_ADAGRAD
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(n, s.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in s.vocab_sizes],
            optimizer=optim, learning_rate=setup.lr, eps=setup.eps, pooling_mode=PoolingMode.SUM,
            weights_precision=SparseType.FP32, output_dtype=SparseType.FP32,
            bounds_check_mode=BoundsCheckMode.NONE,  # the loader checks ids against the vocabularies
            device=torch.device("cpu"),
        )
        self.dense_arch = DenseArch(s.num_dense, s.bottom)
        self.interaction = InteractionArch(len(s.features))
        n = len(s.features) + 1
        self.over = OverArch(s.bottom[-1] + n * (n - 1) // 2, s.top)
        self.num_features, self.dim = len(s.features), s.dim
        if init is not None:
            with torch.no_grad():
                for table, rows in zip(self.tbe.split_embedding_weights(), init.tables()):
                    table.copy_(rows)
            layers = linears(self.dense_arch) + linears(self.over)
            copy_dense(layers, init.dense_layers())
            # TorchRec's interaction lists pairs (i, j), i < j, of the upper
            # triangle; recsys lists (i, j), i > j, of the lower one.
            pos = tril_position(n)
            rows, cols = torch.triu_indices(n, n, offset=1)
            width = s.bottom[-1]
            order = torch.tensor(list(range(width)) + [width + pos[(int(j), int(i))] for i, j in zip(rows, cols)])
            reorder_top_input(linears(self.over)[0], order)
        self.optimizer = dense_optimizer(setup, [*self.dense_arch.parameters(), *self.over.parameters()])

    def transform(self, batch: Batch) -> PeerBatch:
        kjt = batch.sparse
        return PeerBatch(batch, (kjt.values, kjt.offsets()))  # TBE's input: one offsets list over every table's bags

    def step(self, peer: PeerBatch) -> torch.Tensor:
        (indices, offsets), batch = peer.inputs, peer.batch
        pooled = self.tbe(indices, offsets).view(batch.size, self.num_features, self.dim)
        dense = self.dense_arch(batch.dense)
        logits = self.over(self.interaction(dense, pooled)).squeeze(1)
        loss = bce(logits, batch.labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # TBE updates its rows here
        self.optimizer.step()
        return loss


# --- plain PyTorch ---------------------------------------------------------------
class PlainDLRM(nn.Module):
    def __init__(self, shapes: Shapes) -> None:
        super().__init__()
        s = shapes
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, s.dim, mode="sum", sparse=True) for n in s.vocab_sizes)
        self.bottom = self._mlp([s.num_dense, *s.bottom], final_relu=True)
        n = len(s.features) + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.top = self._mlp([s.bottom[-1] + n * (n - 1) // 2, *s.top], final_relu=False)

    @staticmethod
    def _mlp(sizes: list[int], final_relu: bool) -> nn.Sequential:
        layers: list[nn.Module] = []
        for i in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < len(sizes) - 2 or final_relu:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    def forward(self, dense: torch.Tensor, per_table) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = torch.stack([t(v, o) for t, (v, o) in zip(self.tables, per_table)], dim=1)
        t = torch.cat([x.unsqueeze(1), pooled], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.rows, self.cols]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


class Plain(System):
    name = "plain"

    def __init__(self, setup, shapes, data, init: Recsys | None = None) -> None:
        super().__init__(setup, shapes, data)
        self.model = PlainDLRM(shapes)
        if init is not None:
            with torch.no_grad():
                for table, rows in zip(self.model.tables, init.tables()):
                    table.weight.copy_(rows)
            copy_dense(linears(self.model.bottom) + linears(self.model.top), init.dense_layers())
        dense = [p for name, p in self.model.named_parameters() if not name.startswith("tables.")]
        self.optimizer = dense_optimizer(setup, dense)
        self.rowwise = setup.optimizer == "adagrad"
        if self.rowwise:  # row-wise Adagrad's accumulator: one value per row
            self.accumulators = [torch.zeros(n, 1) for n in shapes.vocab_sizes]
        else:
            self.sparse_optimizer = torch.optim.SGD([t.weight for t in self.model.tables], lr=setup.lr)

    def transform(self, batch: Batch) -> PeerBatch:
        return PeerBatch(batch, split_tables(batch))

    def step(self, peer: PeerBatch) -> torch.Tensor:
        loss = bce(self.model(peer.batch.dense, peer.inputs), peer.batch.labels)
        self.optimizer.zero_grad(set_to_none=True)
        for t in self.model.tables:
            t.weight.grad = None
        loss.backward()
        self.optimizer.step()
        if self.rowwise:
            self._rowwise_adagrad()
        else:
            self.sparse_optimizer.step()
        return loss

    @torch.no_grad()
    def _rowwise_adagrad(self) -> None:
        lr, eps = self.setup.lr, self.setup.eps
        for table, acc in zip(self.model.tables, self.accumulators):
            grad = table.weight.grad.coalesce()
            rows, values = grad.indices()[0], grad.values()
            state = acc.index_select(0, rows) + values.square().mean(1, keepdim=True)
            acc.index_copy_(0, rows, state)
            table.weight.index_add_(0, rows, values / (state.sqrt() + eps), alpha=-lr)


# --- the dense ceiling -------------------------------------------------------------
class MLPsOnly(System):
    name = "mlps"

    def __init__(self, setup, shapes, data, cfg) -> None:
        super().__init__(setup, shapes, data)
        from types import SimpleNamespace

        from recsys_cli.model.dlrm import DLRM

        emb = SimpleNamespace(features=shapes.features, dim=shapes.dim)
        m = cfg.model
        self.model = DLRM(shapes.num_dense, emb, shapes.bottom, shapes.top, m.interaction, m.init, seed=setup.seed)
        self.optimizer = dense_optimizer(setup, self.model.parameters())
        self.pooled = torch.randn(setup.batch_size, len(shapes.features), shapes.dim,
                                  generator=torch.Generator().manual_seed(0)) * 0.01

    def step(self, batch: Batch) -> torch.Tensor:
        loss = bce(self.model.dense_forward(batch.dense, self.pooled), batch.labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss


def build(name: str, setup: Setup, cfg, shapes: Shapes, data: Path, init: Recsys | None) -> System:
    if name == "recsys":
        return init if init is not None else Recsys(setup, shapes, data, cfg)
    if name == "tbe":
        return TBE(setup, shapes, data, init)
    if name == "plain":
        return Plain(setup, shapes, data, init)
    if name == "mlps":
        return MLPsOnly(setup, shapes, data, cfg)
    raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
