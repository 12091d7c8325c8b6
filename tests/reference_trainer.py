"""The reference trainer of the differential tests: DLRM written the obvious way.

Every table is one dense fp32 tensor; a batch's embeddings are pooled with
Python loops over its bags, and every row's gradient is the sum, in batch
order, of the pooled gradients of the bags that hold it. Rows are updated
with the project's row optimizer (RowOptimizer.step) and, for a
low-precision table, quantized with the project's quantizer at the steps the
system wrote them to its store (the residency sequence, recorded from the
system under test), keyed as the store keys them. No cache, no fused
groups, no plans, no threads: what the system computes through all of those
must come out bit for bit the same.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.quant import INIT_STEP, RoundingKey, make_rows
from recsys_cli.model.dlrm import DLRM


class ReferenceTrainer:
    def __init__(self, model: DLRM, tables: dict[str, torch.Tensor], features: list[str], optimizer: RowOptimizer,
                 dense_optimizer: str, lr: float, precision: dict[str, str] | None = None,
                 rounding: str = "stochastic", seed: int = 0) -> None:
        """model: the system's model before training (its dense weights are
        copied); tables: every table's initial fp32 rows; precision: per
        table, the precision of the store behind it (fp32 when absent)."""
        self.features = features
        self.optimizer = optimizer
        self.precision = precision or {}
        self.rounding, self.seed = rounding, seed
        emb = SimpleNamespace(features=features, dim=next(iter(tables.values())).shape[1])
        self.dense = DLRM(model.bottom[0].in_features, emb, [m.out_features for m in model.bottom if hasattr(m, "out_features")],
                          [m.out_features for m in model.top if hasattr(m, "out_features")], model.interaction)
        own = {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
        self.dense.load_state_dict(own)
        params = list(self.dense.parameters())
        self.dense_opt = torch.optim.SGD(params, lr=lr) if dense_optimizer == "sgd" else torch.optim.Adagrad(params, lr=lr)
        self.tables = {name: t.clone() for name, t in tables.items()}
        width = 1 if optimizer.has_state else 0
        self.state = {name: torch.full((t.shape[0], width), optimizer.initial_accumulator) for name, t in tables.items()}
        for name in self.tables:  # a low-precision store holds its rows quantized from the start
            if self.precision.get(name, "fp32") != "fp32":
                self.quantize(name, list(range(self.tables[name].shape[0])), INIT_STEP)

    def quantize(self, table: str, rows: list[int], step: int) -> None:
        """The value a row has after the store stored it at `step`."""
        number = self.features.index(table)
        for r in rows:
            key = RoundingKey(self.seed, torch.tensor([number]), torch.tensor([r]), step)
            stored = make_rows(self.tables[table][r : r + 1], self.precision[table], self.rounding, key)
            self.tables[table][r] = stored.read(torch.tensor([0]))[0]

    def step(self, batch, writes: dict[str, list[int]] | None = None, step: int | None = None) -> float:
        """One training step; then the rows the system stored at `step`
        (writes: table -> rows) take their stored values."""
        bags = batch.sparse.to_dict()
        size = batch.dense.shape[0]
        dim = next(iter(self.tables.values())).shape[1]
        pooled = torch.zeros(size, len(self.features), dim)
        for f, name in enumerate(self.features):
            for b, ids in enumerate(bags[name]):
                acc = torch.zeros(dim)
                for i in ids:
                    acc = acc + self.tables[name][i]
                pooled[b, f] = acc
        pooled.requires_grad_()
        loss = F.binary_cross_entropy_with_logits(self.dense.dense_forward(batch.dense, pooled), batch.labels)
        self.dense_opt.zero_grad()
        loss.backward()
        grad = pooled.grad
        for f, name in enumerate(self.features):
            row_grad: dict[int, torch.Tensor] = {}
            for b, ids in enumerate(bags[name]):  # batch order, as the system's backward sums
                for i in ids:
                    row_grad[i] = row_grad.get(i, torch.zeros(dim)) + grad[b, f]
            if not row_grad:
                continue
            ids = sorted(row_grad)
            index = torch.tensor(ids)
            rows, state = self.optimizer.step(self.tables[name][index], self.state[name][index],
                                              torch.stack([row_grad[i] for i in ids]))
            self.tables[name][index] = rows
            self.state[name][index] = state
        self.dense_opt.step()
        for name, rows in (writes or {}).items():
            self.quantize(name, rows, step)
        return loss.item()
