"""The dataset a run trains on: its directory, its manifest, and how its batches hold sessions.

Resolved before the trainer builds anything, so that a wrong path, an
unlabelled dataset or a model whose features the data lacks fails as one
line before tables are allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

from omegaconf import OmegaConf

from data_tools.manifest import MANIFEST_NAME, Manifest, ManifestError, load_manifest
from recsys_cli.errors import UserError


def resolve_dataset(dataset) -> Path:
    """The dataset directory: dataset.path, or the built-in synthetic data,
    generated on first use."""
    try:
        path = dataset.path
    except Exception:  # OmegaConf's MissingMandatoryValue for `path: ???`
        raise UserError(f"dataset {dataset.name} needs dataset.path=DIR (a `recsys preprocess` output)") from None
    if path:
        return Path(path).expanduser()
    if not dataset.name.startswith("synthetic"):
        raise UserError(f"dataset {dataset.name} needs dataset.path=DIR (a `recsys preprocess` output)")
    from data_tools.synthetic import SyntheticConfig, default_dataset

    synthetic = SyntheticConfig(**cast(dict, OmegaConf.to_container(dataset.synthetic, resolve=True)))
    return default_dataset(synthetic, Path(dataset.cache_dir).expanduser() if dataset.cache_dir else None)


@dataclass(frozen=True)
class TrainingData:
    directory: Path
    manifest: Manifest
    keep_sessions: bool  # the training loader shuffles whole sessions

    @property
    def features(self) -> list[str]:
        return self.manifest.feature_names

    @property
    def vocab_sizes(self) -> list[int]:
        return [f.vocab_size for f in self.manifest.sparse_features]


def training_data(cfg) -> TrainingData:
    """The labelled dataset `cfg` names, checked against the model's features."""
    directory = resolve_dataset(cfg.dataset)
    try:
        manifest = load_manifest(directory)
    except ManifestError as e:
        raise UserError(str(e)) from None
    if not manifest.labelled:
        raise UserError(f"{directory} has no labels (preprocessed with labels=false): train on labelled "
                        "data, and score this one with `recsys predict`")
    features = manifest.feature_names
    if cfg.model.features is not None and list(cfg.model.features) != features:
        raise UserError(
            f"model {cfg.model.name} expects sparse features {list(cfg.model.features)}, "
            f"but {directory}/manifest.json has {features}"
        )
    check_train_rows(cfg.trainer, manifest, directory)
    return TrainingData(directory, manifest, session_shuffle(cfg.dedup, manifest.session_column, directory))


def check_train_rows(trainer, manifest: Manifest, directory: Path) -> None:
    """The train split holds at least one batch the run can train on: with
    trainer.drop_last=true (the default) a split smaller than one global batch
    has none, and the loader's ValueError was a traceback mid-start."""
    split = manifest.splits.get("train")
    rows = split.rows if split is not None else 0
    if rows == 0:
        raise UserError(f"split 'train' of {directory} has no rows: nothing to train on")
    if trainer.drop_last and rows < trainer.batch_size:
        raise UserError(
            f"split 'train' of {directory} has {rows:,} rows, fewer than one global batch of "
            f"trainer.batch_size={trainer.batch_size}: lower trainer.batch_size, or set trainer.drop_last=false "
            "to train on them as one smaller batch (one process only)"
        )


def session_shuffle(dedup, session_column: str | None, directory: Path) -> bool:
    """Whether the loader shuffles whole sessions. By default exactly when
    dedup is on and the dataset has a session column: in-batch dedup of
    ids needs no sessions, they only make batches hold more duplicates."""
    if dedup.keep_sessions is None:
        return bool(dedup.enabled and session_column)
    if dedup.keep_sessions and not session_column:
        raise UserError(
            f"dedup.keep_sessions=true but {directory}/{MANIFEST_NAME} names no session column "
            "(use dataset=synthetic_sessions, or leave dedup.keep_sessions unset)"
        )
    return bool(dedup.keep_sessions)
