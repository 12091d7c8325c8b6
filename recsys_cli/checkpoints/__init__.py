"""Checkpoints: the format both training and inference stand on (Lightning's CheckpointIO).

What a checkpoint is on disk, how it is written, read back, checked and
re-sharded, with nothing of when to save or what a trainer's state holds
(train/ decides when to save and hands over its state; train/restore.py
puts a checkpoint's parts back into a trainer's modules). One module a concept:

  layout.py       the files' names, a sharded checkpoint's reference, the shard manifest
  record.py       step-N.files.json: every file of a checkpoint with its size and checksum
  write.py        save_checkpoint (temporary name + rename, latest.json), prune, best.json
  shard_write.py  save_shards: every rank writes its rows of a sharded run (collective)
  read.py         find_checkpoint, load_checkpoint (checked first, weights_only)
  reshard.py      a shard directory read back for any row range and process count
  verify.py       each file against its record; nothing that could run code

The names below are the layer's interface; its modules import each other
in that order, bottom up (layout, record, verify, reshard, read, shard_write, write).
"""

from recsys_cli.checkpoints.layout import (BEST, LATEST, MANIFEST, METADATA, is_sharded, shard_dir, shard_dir_of,
                                           step_file, tables_reference)
from recsys_cli.checkpoints.read import (best_file, best_step, find_checkpoint, find_latest_run_checkpoint,
                                         load_checkpoint, newest_checkpoint, read_latest)
from recsys_cli.checkpoints.record import read_record, record_path, write_record
from recsys_cli.checkpoints.reshard import ShardReader, assemble_tables, load_rank_caches, load_shard
from recsys_cli.checkpoints.shard_write import save_shards
from recsys_cli.checkpoints.verify import checkpoint_problems, intact_before, unsafe_problems, verify_checkpoint_file
from recsys_cli.checkpoints.write import mark_best, prune, save_checkpoint, space_note

__all__ = [
    "BEST", "LATEST", "MANIFEST", "METADATA", "ShardReader", "assemble_tables", "best_file", "best_step",
    "checkpoint_problems", "find_checkpoint", "find_latest_run_checkpoint", "intact_before", "is_sharded",
    "load_checkpoint", "load_rank_caches", "load_shard", "mark_best", "newest_checkpoint", "prune", "read_latest",
    "read_record", "record_path", "save_checkpoint", "save_shards", "shard_dir", "shard_dir_of", "space_note",
    "step_file", "tables_reference", "unsafe_problems", "verify_checkpoint_file", "write_record",
]
