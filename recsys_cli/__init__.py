"""recsys: train DLRM models whose embedding tables do not fit the device.

Data flows through the packages in this order:
  data (shards, loader, jagged batches) -> embeddings (stores, cache, prefetcher,
  collection) -> model (DLRM) -> train (trainer, metrics, checkpoints).

The library API (issue 42 item 7)
---------------------------------
The names in `__all__` below are recsys's public API: what a program may
import from `recsys_cli` to build a Trainer from a config, read a dataset
and score an exported model. They keep their meaning across releases; a
change to one is announced with a deprecation first. Everything else, every
submodule (`recsys_cli.train.trainer`, `recsys_cli.embeddings...`) and every
name not listed here, is internal: it may change in any release without
notice, whatever its spelling (no leading underscore is needed to mark it).
Import the public names from `recsys_cli` itself, not from where they live.

`import recsys_cli` is cheap (no torch, Hydra or pyarrow): each name is
imported when it is first used (the module's __getattr__).

  train_config(overrides)  the config `recsys train OVERRIDES` runs, composed
                           and checked (a DictConfig; UserError names a bad key)
  Trainer(cfg, run_dir)    builds the data, tables and model; .fit() trains and
                           returns the run's summary (summary.json's dict)
  load_manifest(dir)       a dataset directory's manifest: splits, rows, features
  ShardLoader(dir, split, batch_size, shuffle=, drop_last=)
                           iterates a split in Batch-es (dense, sparse, labels)
  Batch                    one batch: dense float32 [B, 13], sparse ids, labels [B]
  load_scorer(path)        an exported model (`recsys export`) as a torch module:
                           model(dense, categorical) -> click probabilities [B]
  load_metadata(path)      an exported model's metadata, without loading it
  raw_inputs(lines)        Criteo TSV lines -> (dense, categorical), the scorer's inputs
  UserError                what every function above raises for bad input: one line

Examples (tests/test_api.py runs each, in this order, in one directory, after
the `recsys` commands named in the paragraph before it).

Read a dataset, here one made by `recsys preprocess synthetic rows=5000 cardinality_scale=0.001
output=raw.tsv format=tsv` and `recsys preprocess criteo input=raw.tsv output=data/small`::

    from recsys_cli import ShardLoader, load_manifest

    manifest = load_manifest("data/small")
    print({name: split.rows for name, split in manifest.splits.items()})
    for batch in ShardLoader("data/small", "val", batch_size=256, shuffle=False, drop_last=False):
        print(batch.size, tuple(batch.dense.shape), f"click rate {float(batch.labels.mean()):.3f}")

Build a Trainer from a config, with the overrides the train command takes::

    from pathlib import Path
    from recsys_cli import Trainer, train_config

    cfg = train_config(["dataset.path=data/small", "trainer.batch_size=64", "trainer.max_steps=60",
                        "trainer.progress=false"])
    summary = Trainer(cfg, run_dir=Path("runs/first")).fit()
    print(f"val AUC {summary['final']['val']['auc']:.4f} after {summary['steps']} steps")

Score raw Criteo rows with an exported model, after `recsys export checkpoint=runs/first convert=int8
format=module`::

    from itertools import islice
    from recsys_cli import load_metadata, load_scorer, raw_inputs

    model = load_scorer("runs/first/model-int8.scorer.pt")
    print(load_metadata("runs/first/model-int8.scorer.pt")["precision"])
    with open("raw.tsv") as f:
        dense, categorical = raw_inputs(islice(f, 5))  # the label column is detected and left out
    print(model(dense, categorical))  # click probabilities
"""

from __future__ import annotations

import typing as _typing
from importlib import import_module as _import_module

if _typing.TYPE_CHECKING:  # the real names for type checkers; at run time they load on first use
    from data_tools.manifest import load_manifest
    from recsys_cli.data.batch import Batch
    from recsys_cli.data.loader import ShardLoader
    from recsys_cli.errors import UserError
    from recsys_cli.export import load_metadata, load_scorer, raw_inputs
    from recsys_cli.train.app import train_config
    from recsys_cli.train.trainer import Trainer

# name -> the module it lives in (internal: import it from here)
_PUBLIC = {
    "train_config": "recsys_cli.train.app",
    "Trainer": "recsys_cli.train.trainer",
    "load_manifest": "data_tools.manifest",
    "ShardLoader": "recsys_cli.data.loader",
    "Batch": "recsys_cli.data.batch",
    "load_scorer": "recsys_cli.export",
    "load_metadata": "recsys_cli.export",
    "raw_inputs": "recsys_cli.export",
    "UserError": "recsys_cli.errors",
}

__all__ = ["Batch", "ShardLoader", "Trainer", "UserError", "load_manifest", "load_metadata", "load_scorer",
           "raw_inputs", "train_config"]


def __getattr__(name: str) -> _typing.Any:
    """A public name, imported on first use (PEP 562): `import recsys_cli` stays cheap."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'recsys_cli' has no attribute {name!r}")
    value = getattr(_import_module(_PUBLIC[name]), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    """The public names (and the module's own dunders): what `dir(recsys_cli)` and completion offer."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})
