"""A small training loop over hand-made batches, for embedding tests that
should not depend on the loader: the same batches through every placement."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from recsys_cli.config import PlacementConfig, PrecisionConfig
from recsys_cli.data.batch import Batch
from recsys_cli.data.jagged import KeyedJaggedTensor
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.placement import build_embeddings
from recsys_cli.embeddings.prefetch import Prefetcher
from recsys_cli.model.dlrm import DLRM

FEATURES = ["a", "b", "c", "h"]  # h is multi-hot
VOCAB = [50, 7, 300, 120]


def make_batches(n: int, batch_size: int = 16, seed: int = 0, max_len: int = 6) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        per_key = {}
        for f, v in zip(FEATURES, VOCAB):
            bags = []
            for _ in range(batch_size):
                length = int(torch.randint(0, max_len + 1, (1,), generator=gen)) if f == "h" else 1
                # Zipf-ish: squares of uniforms concentrate on small ids.
                ids = (torch.rand(length, generator=gen) ** 3 * v).long().clamp_(max=v - 1)
                bags.append(ids.tolist())
            per_key[f] = bags
        batches.append(Batch(
            dense=torch.rand(batch_size, 13, generator=gen),
            sparse=KeyedJaggedTensor.from_lists(per_key),
            labels=(torch.rand(batch_size, generator=gen) < 0.3).float(),
        ))
    return batches


def build(placement: dict | None = None, precision: dict | None = None, optimizer: str = "sgd", seed: int = 0,
          lr: float = 0.1):
    place = OmegaConf.merge(OmegaConf.structured(PlacementConfig), placement or {})
    prec = OmegaConf.merge(OmegaConf.structured(PrecisionConfig), precision or {})
    torch.manual_seed(seed)
    emb = build_embeddings(FEATURES, VOCAB, 8, place, prec, RowOptimizer(optimizer, lr), torch.device("cpu"), seed)
    model = DLRM(13, emb, [16, 8], [16, 1])
    opt = torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd" else torch.optim.Adagrad(model.parameters(), lr=lr)
    return model, opt


def run(batches: list[Batch], placement: dict | None = None, precision: dict | None = None,
        optimizer: str = "sgd", model_opt=None):
    """Train on `batches`; return (per-step losses, fp32 tables, dense state)."""
    model, opt = model_opt or build(placement, precision, optimizer)
    emb = model.embeddings
    fresh = [Batch(b.dense, b.sparse, b.labels, b.session) for b in batches]
    planned = (emb.plan(b) for b in fresh)
    ahead = [(i, g) for i, g in enumerate(emb.groups) if getattr(g, "lookahead", False)]
    losses = []
    with Prefetcher(planned, ahead, emb.release) as stream:
        for batch in stream:
            for group, plan in zip(emb.groups, batch.extras["plans"]):
                if not getattr(group, "lookahead", False):
                    group.prepare(plan)
            loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
            opt.zero_grad()
            loss.backward()
            emb.step()
            emb.release(batch)
            opt.step()
            losses.append(loss.item())
    return losses, tables_fp32(emb), {k: v.clone() for k, v in model.state_dict().items()}


def tables_fp32(emb) -> dict[str, torch.Tensor]:
    out = {}
    for g in emb.groups:
        for t in g.tables:
            lo = g.row_offset[t.name]
            out[t.name] = g.read(torch.arange(lo, lo + t.num_rows)).clone()
    return out
