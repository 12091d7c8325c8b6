"""Starting a Trainer from a checkpoint: resume a run, or initialise a new one from it.

Apart from trainer.py so that it reads as the training loop. Each function
loads the checkpoint into the modules it is given (the model, the dense
optimizer, the embeddings: each through its own load method) and returns
what the trainer itself keeps: a resume returns the run's position
(`Resumed`), init_from only the checkpoint it read. It writes no attribute
of the Trainer. A resumed run continues bit for bit (the loader position,
RNG, caches and the metrics so far come back); init_from takes weights and
optimizer state only, and keeps the new run's own step count, data order,
RNGs and hyperparameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import torch
from omegaconf import OmegaConf

from recsys_cli.checksum import DamagedFile
from recsys_cli.embeddings.disk_checkpoint import is_disk_table, materialize
from recsys_cli.embeddings.sharding import ShardPlan
from recsys_cli.errors import UserError
from recsys_cli import checkpoints as ckpt
from recsys_cli.train import distributed
from recsys_cli.train.dense_optim import DenseOptimizer
from recsys_cli.train.training_data import TrainingData


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run continues: the trainer's counters, the metrics
    so far and the next log line's running loss, as the checkpoint saved them."""

    path: Path
    step: int
    epoch: int
    batch_in_epoch: int
    samples: int
    metrics: list[str] | None  # metrics.jsonl's lines up to the step (None: a checkpoint older than saved metrics)
    running_loss: torch.Tensor | None
    running_steps: int
    loop: dict | None = None  # the loop rules' state (loop_control.py); None: a checkpoint older than them
    strategy: dict | None = None  # the saving run's Strategy.state_dict() (None: a checkpoint older than that)
    # every saving rank's training-batch counts (Trainer.counts_per_rank; None: a checkpoint older than them)
    train_counts: list | None = None


class Tables(Protocol):
    """What a checkpoint's tables and caches load into: the trainer's
    EmbeddingBagCollection or ShardedEmbeddingBagCollection."""

    @property
    def shard_plan(self) -> ShardPlan | None: ...

    def tables_with_restored_caches(self, saved: list | None) -> set[str]: ...

    def load_table_state(self, tables: dict[str, dict]) -> None: ...

    def load_cache_snapshot(self, saved: list | None, step: int) -> None: ...


@dataclass(frozen=True)
class Restorable:
    """What a checkpoint loads into: the modules the Trainer built."""

    model: torch.nn.Module
    dense_optimizer: DenseOptimizer
    embeddings: Tables  # model.embeddings


# trainer.resume's words for "the latest checkpoint" (true: the older spelling, still read)
LATEST_WORDS = ("last", "true")


def resume_path(resume: str, checkpoint_dir: Path | None, run_dir: Path | None) -> Path:
    """The checkpoint trainer.resume names (a checkpoint, a directory, or "last": the latest),
    as rank 0 chose it: every rank loads the same one."""
    return distributed.broadcast_object(locate_resume(resume, checkpoint_dir, run_dir))  # a no-op alone


def locate_resume(resume: str, checkpoint_dir: Path | None, run_dir: Path | None) -> Path:
    """The checkpoint trainer.resume names, found in this process (also
    before composition: resume_overrides.py takes that run's overrides)."""
    if str(resume).lower() in LATEST_WORDS:
        if checkpoint_dir is not None and (checkpoint_dir / ckpt.LATEST).exists():
            return ckpt.find_checkpoint(checkpoint_dir)
        outputs = run_dir.parent.parent if run_dir else Path("outputs")
        return ckpt.find_latest_run_checkpoint(outputs)
    return ckpt.find_checkpoint(resume)


def resume(path: Path, cfg, data: TrainingData, into: Restorable) -> Resumed:
    """Load the run saved at `path` into `into` and return where it continues.
    A damaged file of the checkpoint (checksum.py) is one line naming it and
    the newest older checkpoint that is intact, to resume from instead."""
    try:
        return _resume(path, cfg, data, into)
    except DamagedFile as e:
        older = ckpt.intact_before(path)
        then = (f"the older checkpoint {older} is intact: resume from it with trainer.resume={older}"
                if older is not None else f"no older checkpoint in {Path(path).parent} is intact")
        raise UserError(f"{e}; {then}") from None


def _resume(path: Path, cfg, data: TrainingData, into: Restorable) -> Resumed:
    sharded = into.embeddings.shard_plan is not None
    state = ckpt.load_checkpoint(path, keep_patches=True, whole_tables=not sharded)
    if sharded:
        state["tables"], state["caches"] = own_rows(into.embeddings, state["tables"])
    if "config" in state:
        check_resumable(path, state["config"], cast(dict, OmegaConf.to_container(cfg, resolve=True)))
    expected = feature_sizes(data)
    if state["features"] != expected:
        raise UserError(f"checkpoint {path} was trained on features {state['features']}, the dataset has {expected}")
    try:
        into.model.load_state_dict(state["model"])
        into.dense_optimizer.load_state_dict(state["dense_optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:  # a checkpoint of another model that the config check missed
        raise UserError(f"checkpoint {path} does not fit this model: {_first_problem(e)}") from None
    # A table whose cache comes back exactly is loaded as saved, its dirty
    # rows' stale values included (they stay in the cache, and nothing reads
    # the store's copy of a resident row): the store then equals the
    # uninterrupted run's byte for byte, so its later checkpoints do too.
    # Any other table takes its patch (materialize puts it in).
    restored = into.embeddings.tables_with_restored_caches(state.get("caches"))
    into.embeddings.load_table_state({name: {k: v for k, v in t.items() if k != "patch"} if name in restored else t
                                      for name, t in state["tables"].items()})
    into.embeddings.load_cache_snapshot(state.get("caches"), state["step"])
    torch.set_rng_state(state["torch_rng"])
    loss, steps = state["running_loss"] if "metrics" in state else (None, 0)
    return Resumed(path, state["step"], state["epoch"], state["batch_in_epoch"], state["samples"],
                   state.get("metrics"), loss, steps, state.get("loop"),
                   state.get("strategy") or _older_strategy_state(state), state.get("train_counts"))


def _first_problem(e: BaseException) -> str:
    """The first problem torch's load_state_dict names: its message's first
    line is only the header "Error(s) in loading state_dict for DLRM:", which
    was all the one-line error said."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Error(s) in loading state_dict"):
        return lines[1].split("\t")[0].rstrip(".")
    return lines[0] if lines else type(e).__name__


def _older_strategy_state(state: dict) -> dict | None:
    """cache_avg's sync points as checkpoints kept them before the strategy
    saved its own state (in each cache snapshot), in state_dict's form."""
    caches = state.get("caches") or []
    if not any(c is not None and c.get("sync_points") is not None for c in caches):
        return None
    keys = ("kind", "capacity", "precision", "tables")
    groups = [None if c is None or c.get("sync_points") is None else
              {**{k: c[k] for k in keys}, "syncs": 0, "sync_points": list(c["sync_points"])} for c in caches]
    return {"mode": "cache_avg", "world_size": None, "groups": groups}


def init_from(location: str, cfg, data: TrainingData, into: Restorable) -> tuple[Path, int]:
    """Weights and optimizer state (dense and per row) from a checkpoint,
    into this new run: its own step count, data order and RNGs, and its
    own optimizer hyperparameters (lr...). Returns the checkpoint and the
    steps it was trained."""
    path = distributed.broadcast_object(ckpt.find_checkpoint(location))  # rank 0's choice
    sharded = into.embeddings.shard_plan is not None
    state = ckpt.load_checkpoint(path, whole_tables=not sharded)
    if sharded:
        state["tables"], _ = own_rows(into.embeddings, state["tables"])
    expected = feature_sizes(data)
    if state.get("features") != expected:
        raise UserError(f"vocabulary mismatch: trainer.init_from={path} was trained on features "
                        f"{state.get('features')}, {data.directory} has {expected}")
    ours = data.manifest.options.get("vocabulary", {}).get("fingerprint")
    if state.get("vocabulary") and ours and state["vocabulary"] != ours:
        raise UserError(f"vocabulary mismatch: {data.directory} has another vocabulary than the data "
                        f"{path} was trained on (preprocess it with vocab=THAT_DATASET)")
    try:
        into.model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise UserError(f"trainer.init_from={path}: its model does not fit this config's "
                        f"({_first_problem(e)})") from None
    optimizer = into.dense_optimizer
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(state["dense_optimizer"])
    except ValueError as e:
        saved = state.get("config")
        was = saved.get("optimizer", {}).get("name") if isinstance(saved, dict) else None
        trained = f"it was trained with optimizer.name={was}: " if was else ""
        raise UserError(f"trainer.init_from={path}: its optimizer state does not fit optimizer."
                        f"name={cfg.optimizer.name} ({trained}{e})") from None
    for group, h in zip(optimizer.param_groups, hyper):
        group.update(h)
    into.embeddings.load_table_state(state["tables"])
    return path, state["step"]


def own_rows(embeddings, tables: dict) -> tuple[dict, list | None]:
    """A sharded run's rows of a checkpoint, for this rank's shards, and its
    caches when the checkpoint can give them back exactly. From a sharded
    checkpoint (its "tables" the shard directory's reference), whatever
    world size saved it: each shard's rows are cut from and joined across the
    saved pieces that overlap it (re-sharding 2 -> 1, 1 -> 2, 2 -> 4), and
    this rank's saved caches come back when the same plan saved them. From
    whole tables (one process's or a replicated run's checkpoint): each
    shard's rows cut from its table, the caches empty. Either way a patch
    (dirty cache rows) stays beside, for load_table_state to put in or keep."""
    plan = embeddings.shard_plan
    mine = plan.owned(embeddings.rank)
    if ckpt.is_sharded(tables):
        directory = tables["directory"]
        rows = {s.table: ckpt.load_shard(directory, s.table, s.lo, s.hi) for s in mine}
        same = ShardPlan.from_dict(tables["plan"]).shards == plan.shards
        return rows, ckpt.load_rank_caches(directory, embeddings.rank, plan.world_size) if same else None
    return {s.table: rows_of(tables[s.table], s.lo, s.hi) for s in mine}, None


def rows_of(entry: dict, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of a table entry (a disk table read whole first), its patch cut to them and rebased."""
    if is_disk_table(entry):
        entry = materialize(entry)
    out = {k: v[lo:hi] if isinstance(v, torch.Tensor) else v for k, v in entry.items() if k != "patch"}
    patch = entry.get("patch")
    if patch is not None:
        inside = (patch["rows"] >= lo) & (patch["rows"] < hi)
        out["patch"] = {k: (v - lo if k == "rows" else v)[inside] for k, v in patch.items()}
    return out


def feature_sizes(data: TrainingData) -> dict[str, int]:
    """What a checkpoint records of its dataset's features: name -> vocabulary size."""
    return {f.name: f.vocab_size for f in data.manifest.sparse_features}


# What a resumed run may change: where and in what precision the tables live,
# how the trainer runs (but not the batch size: the loader position counts
# batches) and where the dataset lies. Everything else (the model, the
# optimizer, dedup, the dataset's content) must be the checkpoint's.
RESUMABLE = ("placement.", "precision.", "trainer.", "dataset.path", "dataset.cache_dir")

NOT_RESUMABLE = ("trainer.batch_size",)


def _flatten(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    out: dict = {}
    for k, v in node.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def check_resumable(path: Path, saved: dict, current: dict) -> None:
    """UserError naming every key that differs and may not change on resume.
    Keys only one side has (a newer or older config schema) are not compared."""
    a, b = _flatten(saved), _flatten(current)
    differ = [
        f"{key}={a[key]!r} in the checkpoint, {b[key]!r} now"
        for key in sorted(a.keys() & b.keys())
        if a[key] != b[key] and (not key.startswith(RESUMABLE) or key in NOT_RESUMABLE)
    ]
    if differ:
        raise UserError(
            f"checkpoint {path} was trained with another config: {'; '.join(differ)} (a resume may change only "
            "placement.*, precision.*, trainer.* but trainer.batch_size, dataset.path and dataset.cache_dir)"
        )
