"""A small training loop over hand-made batches, for embedding tests that
should not depend on the loader: the same batches through every placement.

train() is the loop the trainer runs (prefetcher, prepare, step, release),
with what the differential tests need around it: random sleeps on both
threads (jitter) so thread timing differs from run to run, a record of every
row the stores wrote and at which step (the residency sequence the reference
trainer replays), and a checkpoint taken after a given step the way the
trainer takes one (prefetcher paused there), which resume() continues from.
"""

from __future__ import annotations

import io
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field

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


@dataclass
class Run:
    losses: list[float]
    writes: dict = field(default_factory=dict)  # step -> table -> local rows the stores wrote
    window_used: list[int] = field(default_factory=list)
    checkpoint: bytes | None = None


def record_writes(emb) -> dict:
    """Log every keyed store write of `emb`'s groups: step -> table -> rows."""
    log: dict = defaultdict(lambda: defaultdict(list))
    for g in emb.groups:
        original = g.store.write

        def write(ids, rows, state, step=None, g=g, original=original):
            if step is not None:
                for fused in ids.tolist():
                    t = max((t for t in g.tables if g.row_offset[t.name] <= fused), key=lambda t: g.row_offset[t.name])
                    log[step][t.name].append(fused - g.row_offset[t.name])
            original(ids, rows, state, step)

        g.store.write = write
    return log


def _jittered(items, rng: random.Random | None):
    for item in items:
        if rng is not None and rng.random() < 0.3:
            time.sleep(rng.random() * 0.002)
        yield item


def checkpoint_bytes(model, opt, step: int) -> bytes:
    """What the trainer's checkpoint holds of the embeddings and the dense model, as a file."""
    state = {"step": step, "model": model.state_dict(), "dense_optimizer": opt.state_dict(),
             "tables": model.embeddings.table_state(patch_beside=True), "caches": model.embeddings.cache_snapshot()}
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def train(batches: list[Batch], model, opt, *, start: int = 0, jitter: int | None = None,
          checkpoint_at: int | None = None, log_writes: bool = False) -> Run:
    """Train on batches[start:] (steps start, start+1, ...)."""
    emb = model.embeddings
    writes = record_writes(emb) if log_writes else {}
    trainer_rng = random.Random(jitter) if jitter is not None else None
    thread_rng = random.Random(jitter + 1) if jitter is not None else None
    fresh = [Batch(b.dense, b.sparse, b.labels, b.session) for b in batches[start:]]
    planned = _jittered((emb.plan_batch(b) for b in fresh), thread_rng)
    ahead = [(i, g) for i, g in enumerate(emb.groups) if g.lookahead]
    losses, checkpoint = [], None
    pause = (lambda s: s == checkpoint_at) if checkpoint_at is not None else None
    with Prefetcher(planned, ahead, emb.release, start=start, pause_at=pause) as feed:
        step = start
        for batch in feed:
            for group, plan in zip(emb.groups, batch.plans):
                if not group.lookahead:
                    group.prepare(plan)
            loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
            opt.zero_grad()
            loss.backward()
            emb.step()
            emb.release(batch)
            opt.step()
            losses.append(loss.item())
            step += 1
            if step == checkpoint_at:
                checkpoint = checkpoint_bytes(model, opt, step)
            feed.passed(step)
            if trainer_rng is not None and trainer_rng.random() < 0.3:
                time.sleep(trainer_rng.random() * 0.002)
    return Run(losses, {s: {t: list(r) for t, r in v.items()} for s, v in writes.items()}, feed.window_used, checkpoint)


def resume(checkpoint: bytes, model, opt) -> int:
    """Load a checkpoint_bytes() file into a freshly built model; returns its step."""
    state = torch.load(io.BytesIO(checkpoint), weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["dense_optimizer"])
    model.embeddings.load_table_state(state["tables"])
    model.embeddings.load_cache_snapshot(state["caches"], state["step"])
    return state["step"]


def run(batches: list[Batch], placement: dict | None = None, precision: dict | None = None,
        optimizer: str = "sgd", model_opt=None):
    """Train on `batches`; return (per-step losses, fp32 tables, dense state)."""
    model, opt = model_opt or build(placement, precision, optimizer)
    result = train(batches, model, opt)
    return result.losses, tables_fp32(model.embeddings), dense_state(model)


def dense_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def tables_fp32(emb) -> dict[str, torch.Tensor]:
    out = {}
    for g in emb.groups:
        for t in g.tables:
            lo = g.row_offset[t.name]
            out[t.name] = g.read(torch.arange(lo, lo + t.num_rows)).clone()
    return out


def initial_tables(optimizer: str = "sgd") -> dict[str, torch.Tensor]:
    """Every table's fp32 rows before training: initial values do not depend
    on placement or precision, so a device build's are everyone's."""
    model, _ = build({"kind": "device"}, optimizer=optimizer)
    return tables_fp32(model.embeddings)


def assert_identical(a, b, where: str = "", skip: frozenset = frozenset()):
    """torch.equal on every tensor of two nested structures, == on everything
    else; dict keys in `skip` (timing) are not compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            if k not in skip:
                assert_identical(a[k], b[k], f"{where}.{k}", skip)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]", skip)
    else:
        assert a == b, where
