"""placement=auto: sample the first training batches and place every table from their skew."""

from __future__ import annotations

import torch

from recsys_cli.data.loader import ShardLoader
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.placement import measure_and_place
from recsys_cli.embeddings.placement_search import TablePlacements
from recsys_cli.train.training_data import TrainingData

SAMPLE_BATCHES = 64


def sample_sparse(data: TrainingData, batch_size: int, seed: int, count: int = SAMPLE_BATCHES) -> list:
    """The sparse ids of the first `count` training batches in the run's own shuffled order:
    whole batches, or the one partial batch of a train split smaller than one
    batch (trainer.drop_last=false; training_data refuses it otherwise)."""
    batches = []
    whole = data.manifest.splits["train"].rows >= batch_size
    for batch in ShardLoader(data.directory, "train", batch_size, shuffle=True, seed=seed, drop_last=whole):
        batches.append(batch.sparse)
        if len(batches) == count:
            break
    return batches


def expected_lookups(data: TrainingData, batch_size: int, seed: int, count: int = 8) -> dict[str, float]:
    """Per table, the ids a global batch looks up (placement.sharding=auto's
    second objective): batch_size for a one-hot feature, and for a multi-hot
    one the mean over the first `count` training batches (sampled only then)."""
    features = data.manifest.sparse_features
    out = {f.name: float(batch_size) for f in features if not f.multi_hot}
    multi = [f.name for f in features if f.multi_hot]
    if multi:
        sample = sample_sparse(data, batch_size, seed, count)
        for name in multi:
            per_batch = [kjt.to_kjt() if hasattr(kjt, "to_kjt") else kjt for kjt in sample]
            ids = [int(k.lengths.view(len(k.keys), k.stride)[k.keys.index(name)].sum()) for k in per_batch]
            out[name] = sum(ids) / max(len(ids), 1)
    return out


def auto_placement(cfg, data: TrainingData, row_optimizer: RowOptimizer, device: torch.device) -> TablePlacements:
    """The placements placement=auto trains with on `device`: chosen from the skew of the first training batches."""
    batches = sample_sparse(data, cfg.trainer.batch_size, cfg.trainer.seed)
    return measure_and_place(data.features, data.vocab_sizes, cfg.model.embedding_dim, cfg.placement, cfg.precision,
                     row_optimizer, batches, device)
