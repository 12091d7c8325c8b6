"""`recsys predict checkpoint=RUN_OR_FILE input=RAW.tsv[.gz]|DATASET_DIR output=preds.csv`

Streams rows through a trained model and writes one click probability per
input row, in input order. Raw Criteo TSV (40 fields, or 39 without the
label: detected from the first line, or labels=true|false) is parsed like
`recsys preprocess criteo` parses it (every line is a row: an empty or bad
line is an error naming it, there is no skipping) and mapped with the vocabulary of the
dataset the checkpoint was trained on (or vocab=DIR, which must be the same
vocabulary). A dataset directory (a `recsys preprocess` output made with
that vocabulary, e.g. with vocab=) is read split by split: split=NAME, or
every split in the order its rows had in the input.

Output: CSV with a header; one column `Predicted` (prob_name=), or with
id_start=N also an id column `Id` (id_name=) counting from N: Criteo's
Kaggle test set is scored with id_start=60000000 for the `Id,Predicted`
submission layout. The file is written under a temporary name and renamed
at the end. Memory stays bounded: one block of text (block_size) and one
batch (batch_size, default the run's trainer.eval_batch_size: with the same
batch size fp32 predictions are bit for bit the trainer's evaluation).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from recsys_cli.config import DeviceChoice, PrecisionKind, Range, check_ranges
from recsys_cli.errors import UserError, say
from recsys_cli.inference import LoadedModel, load_model
from recsys_cli.locks import check_not_read, locked_output
from recsys_cli.options import CONVERT_RENAMED, plain_word, help_text, parse_options, require, wants_help


@dataclass
class PredictConfig:
    checkpoint: Optional[str] = None  # a .pt file, a checkpoint directory or a run directory
    input: Any = None  # raw TSV file(s) (a path, a glob or a list: input=[a.txt,b.gz]) or a dataset directory
    output: Optional[str] = None  # CSV file to write
    split: Optional[str] = None  # dataset input: one split (default: all, in input order)
    vocab: Optional[str] = None  # raw input: dataset whose vocabulary maps it (default: the training dataset's)
    labels: Optional[bool] = None  # raw input: 40 fields (true) or 39 (false); default: from the first line
    id_start: Optional[int] = None  # add an id column counting from this number
    id_name: str = "Id"  # the id column's name
    prob_name: str = "Predicted"  # the probability column's name
    batch_size: Optional[int] = None  # rows per batch, >= 1 (unset: the run's trainer.eval_batch_size)
    device: DeviceChoice = DeviceChoice.auto  # auto (cuda when there is one) | cpu | cuda
    # Score with the tables converted to fp32 | fp16 | int8 | int4 (default: as trained).
    convert: Optional[PrecisionKind] = None
    block_size: int = 8 << 20  # bytes of raw text parsed at a time
    # torch intra-op threads, >= 1; unset: half the cores, the other half parse (measured on 2 cores: 1 thread
    # scores 5x faster than 2, whose parallel regions stall whenever the parser threads hold a core)
    threads: Optional[int] = None
    progress: bool = True  # a progress bar on a terminal


# The numbers the options may hold (config.Range, as train's keys): 0 is not a count, never "the default".
RANGES = {"batch_size": Range(1, unset=True), "block_size": Range(1), "threads": Range(1, unset=True)}


# --------------------------------------------------------------------------- sources of rows


def split_order(manifest) -> list[str]:
    """The dataset's splits in the order their rows had in the input."""
    # kaggle and terabyte halve the last day into test, then val; ratios cuts train, val, test
    order = {"kaggle": ["train", "test", "val"], "terabyte": ["train", "test", "val"],
             "ratios": ["train", "val", "test"]}.get(
        manifest.options.get("split_by", manifest.options.get("split")), list(manifest.splits))  # "split": older datasets
    return [s for s in order if s in manifest.splits and manifest.splits[s].rows > 0]


def check_dataset(loaded: LoadedModel, dataset_dir: Path):
    """The dataset's manifest, if its features and vocabulary are the checkpoint's."""
    from data_tools.manifest import ManifestError, load_manifest

    try:
        manifest = load_manifest(dataset_dir)
    except ManifestError as e:
        raise UserError(str(e)) from None
    have = {f.name: f.vocab_size for f in manifest.sparse_features}
    if have != loaded.features:
        raise UserError(f"vocabulary mismatch: {loaded.checkpoint} was trained on features {loaded.features}, "
                        f"{dataset_dir} has {have}")
    theirs = manifest.options.get("vocabulary", {}).get("fingerprint")
    if loaded.vocabulary_fingerprint and theirs and theirs != loaded.vocabulary_fingerprint:
        raise UserError(f"vocabulary mismatch: {dataset_dir} was preprocessed with another vocabulary than "
                        f"{loaded.checkpoint}'s training data (preprocess it with vocab=TRAINING_DATASET)")
    return manifest


def dataset_logits(loaded: LoadedModel, dataset_dir: Path, splits: list[str], batch_size: int,
                   advance=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, labels) batch by batch over the splits, rows in split order."""
    from data_tools.manifest import ManifestError
    from recsys_cli.data.loader import ShardLoader

    for split in splits:
        try:
            loader = ShardLoader(dataset_dir, split, batch_size, shuffle=False, drop_last=False)
            batches = iter(loader)
            while (batch := next(batches, None)) is not None:
                yield loaded.logits(batch).cpu(), batch.labels
                if advance:
                    advance(batch.size)
        except ManifestError as e:  # a shard missing, truncated or of another schema
            raise UserError(str(e)) from None


def training_vocabulary(loaded: LoadedModel, vocab_dir: str | None):
    """The vocabulary raw input is mapped with, checked against the checkpoint's."""
    from data_tools.manifest import ManifestError
    from data_tools.vocab import load_vocabulary

    source = Path(vocab_dir).expanduser() if vocab_dir else loaded.dataset_dir
    if source is None:
        raise UserError(f"{loaded.checkpoint} does not say which dataset it was trained on: give vocab=DATASET_DIR")
    try:
        vocabulary = load_vocabulary(source)
    except ManifestError as e:
        hint = "" if vocab_dir else " (moved? give vocab=DATASET_DIR)"
        raise UserError(f"cannot map raw input: {e}{hint}") from None
    check_dataset(loaded, source)
    if list(vocabulary.features) != list(loaded.features):
        raise UserError(f"vocabulary mismatch: {source} maps features {vocabulary.features}, "
                        f"the model has {list(loaded.features)}")
    return vocabulary


def raw_logits(loaded: LoadedModel, paths: list[Path], vocabulary, labels: bool, batch_size: int,
               block_size: int, advance=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, labels or NaN) over raw TSV rows in input order, in batches of
    exactly batch_size rows (the last may be shorter), whatever the blocks."""
    from data_tools.criteo_input import decoded_blocks

    num = len(vocabulary.features)
    pend_dense: list[np.ndarray] = []
    pend_ids: list[np.ndarray] = []
    pend_labels: list[np.ndarray] = []
    pending = 0

    def take(n: int):
        nonlocal pend_dense, pend_ids, pend_labels, pending
        dense, ids, lab = (np.concatenate(p) if len(p) > 1 else p[0] for p in (pend_dense, pend_ids, pend_labels))
        pend_dense, pend_ids, pend_labels = [dense[n:]], [ids[n:]], [lab[n:]]
        pending -= n
        logits = loaded.logits_onehot(torch.from_numpy(dense[:n]), torch.from_numpy(ids[:n]).long())
        return logits.cpu(), torch.tensor(lab[:n])  # a copy: the parser's arrays are read-only

    done = 0
    for d, nbytes in decoded_blocks(paths, labels=labels, block_size=block_size):
        if not d.rows:
            continue
        ids = np.zeros((d.rows, num), dtype=np.int32)
        for f in range(num):
            ids[d.present[f], f] = vocabulary.lookup(f, d.values[f])
        pend_dense.append(d.dense)
        pend_ids.append(ids)
        pend_labels.append(d.label if d.label is not None else np.full(d.rows, np.nan, dtype=np.float32))
        pending += d.rows
        while pending >= batch_size:
            yield take(batch_size)
        if advance:
            advance(d.rows, nbytes - done)
            done = nbytes
    if pending:
        yield take(pending)


# --------------------------------------------------------------------------- output


class PredictionWriter:
    """CSV rows (id?, probability) to a temporary file renamed into place on close."""

    def __init__(self, output: Path, id_start: int | None, id_name: str, prob_name: str) -> None:
        import pyarrow.csv as pacsv

        if output.is_dir():
            raise UserError(f"output {output} is a directory; give a file name (e.g. {output}/preds.csv)")
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create {output.parent}: {e.strerror or e}") from None
        self.output = output
        self.tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
        try:
            self.file = open(self.tmp, "wb")
        except OSError as e:
            raise UserError(f"output {output} is not writable: {e.strerror or e}") from None
        self.id_start = id_start
        header = [id_name, prob_name] if id_start is not None else [prob_name]
        self.file.write((",".join(header) + "\n").encode())
        self.options = pacsv.WriteOptions(include_header=False, quoting_style="none")
        self.rows = 0

    def write(self, probs: torch.Tensor) -> None:
        import pyarrow as pa
        import pyarrow.csv as pacsv

        n = probs.numel()
        cols = {"p": pa.array(probs.numpy().astype(np.float32, copy=False))}
        if self.id_start is not None:
            cols = {"id": pa.array(np.arange(self.id_start + self.rows, self.id_start + self.rows + n)), **cols}
        pacsv.write_csv(pa.table(cols), self.file, self.options)
        self.rows += n

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.output)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class RowProgress:
    """A rich bar over rows (dataset input) or input bytes (raw input) on a
    terminal; elsewhere (a batch job's log) a line at every tenth of the way."""

    def __init__(self, enabled: bool, total: int, unit: str) -> None:
        self.bar = None
        self.console = None
        self.rows = 0
        self.done = 0
        self.total = total
        self.unit = unit
        self.next_line = 0.1
        self.t0 = time.perf_counter()
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True, highlight=False)
        if not console.is_terminal:
            self.console = console
            return
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.fields[rows]:>12,} rows  {task.fields[rate]:>9,.0f} rows/s"),
                            TimeElapsedColumn(), console=console)
        self.task = self.bar.add_task(f"scoring ({unit})", total=total, rows=0, rate=0.0)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def advance(self, rows: int, amount: int | None = None) -> None:
        self.rows += rows
        self.done += rows if amount is None else amount
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        rate = self.rows / elapsed
        if self.bar is not None:
            self.bar.update(self.task, advance=rows if amount is None else amount, rows=self.rows, rate=rate)
        elif self.console is not None and self.total > 0 and self.done >= self.next_line * self.total:
            from recsys_cli.train.run_log import duration

            share = min(self.done / self.total, 1.0)
            self.next_line = (int(share * 10) + 1) / 10
            eta = elapsed / share * (1 - share)
            self.console.print(f"scoring: {100 * share:.0f} % of the {self.unit}, {self.rows:,} rows, {rate:,.0f} rows/s, "
                               f"elapsed {duration(elapsed)} ETA {duration(eta)}", soft_wrap=True, markup=False)


# --------------------------------------------------------------------------- the command


def check_column_names(cfg: PredictConfig) -> None:
    """The CSV's header is written as given, its rows unquoted: a name with a
    comma, a quote or a line end (id_name=a,b made a three-column header over
    two-column rows), an empty one or two equal names would not read back."""
    names = {"prob_name": cfg.prob_name, **({"id_name": cfg.id_name} if cfg.id_start is not None else {})}
    for key, name in names.items():
        if not name or any(c in name for c in ',"\r\n'):
            raise UserError(f"{key}={name!r}: a CSV column name must be non-empty, without a comma, a quote or a "
                            "line end")
    if cfg.id_start is not None and cfg.id_name == cfg.prob_name:
        raise UserError(f"id_name and prob_name are both {cfg.id_name!r}: the CSV's two columns need two names")


def predict(cfg: PredictConfig, console=None) -> dict:
    from rich.console import Console

    console = console or Console(stderr=True, highlight=False)
    checkpoint = require(cfg.checkpoint, "checkpoint", "predict", "a run directory or a .pt file")
    require(cfg.input, "input", "predict", "raw Criteo TSV, or a dataset directory")
    check_ranges(cfg, RANGES)  # before the output is touched and the model loads
    check_column_names(cfg)
    output = Path(require(cfg.output, "output", "predict", "a CSV file to write")).expanduser()
    if output.is_dir():
        raise UserError(f"output {output} is a directory; give a file name (e.g. {output}/preds.csv)")
    # One writer per output (locks.py), and an unwritable place said before the model loads.
    with locked_output(output, "output", "predict"):
        return _predict(cfg, checkpoint, output, console)


def _predict(cfg: PredictConfig, checkpoint: str, output: Path, console) -> dict:
    from data_tools.criteo_input import labelled, resolve_inputs
    from data_tools.manifest import MANIFEST_NAME

    # a list names raw files, as in `recsys preprocess criteo` (it was OmegaConf's "Cannot convert 'ListConfig'")
    many = isinstance(cfg.input, (list, tuple))
    source = Path(str(cfg.input)).expanduser()
    if many:
        source = Path(os.devnull)  # no dataset directory
    # Options of the other kind of input are refused, not ignored (split=nosuch on raw TSV scored every line).
    if source.is_dir() and (cfg.vocab is not None or cfg.labels is not None):
        raise UserError(f"input {source} is a dataset directory: vocab= and labels= are for raw TSV input")
    if not source.is_dir() and cfg.split is not None:
        raise UserError(f"input {cfg.input} is raw TSV, scored line by line: split= picks a split of a dataset "
                        "directory")
    loaded = load_model(checkpoint, str(cfg.device), plain_word(cfg.convert))
    batch_size = cfg.batch_size if cfg.batch_size is not None else int(loaded.config["trainer"]["eval_batch_size"])
    t0 = time.perf_counter()
    read: list[tuple[str, Path]] = [("checkpoint", loaded.checkpoint)]  # what the output must not replace
    if source.is_dir():
        if not (source / MANIFEST_NAME).is_file():
            raise UserError(f"input {source} is a directory without a manifest.json (give a dataset directory "
                            "or raw TSV files)")
        manifest = check_dataset(loaded, source)
        splits = [cfg.split] if cfg.split else split_order(manifest)
        unknown = [s for s in splits if s not in manifest.splits]
        if unknown:
            raise UserError(f"split {unknown[0]!r} is not in {source} (splits: {', '.join(manifest.splits)})")
        total = sum(manifest.splits[s].rows for s in splits)
        progress = RowProgress(cfg.progress, total, "rows")
        logit_blocks = lambda: dataset_logits(loaded, source, splits, batch_size, progress.advance)  # noqa: E731
        what = f"{source} ({', '.join(splits)})"
        read.append(("input dataset", source))
    else:
        paths = resolve_inputs(list(cfg.input) if many else str(cfg.input))
        vocabulary = training_vocabulary(loaded, cfg.vocab)
        labels = cfg.labels
        if labels is None:
            labels = labelled(paths[0])
        progress = RowProgress(cfg.progress, sum(p.stat().st_size for p in paths), "input bytes")
        logit_blocks = lambda: raw_logits(loaded, paths, vocabulary, labels, batch_size, cfg.block_size,  # noqa: E731
                                          progress.advance)
        what = ", ".join(map(str, paths))
        read += [("input", p) for p in paths]
        if vocabulary.directory is not None:
            read.append(("vocabulary dataset", vocabulary.directory))
    check_not_read(output, read, "predict")
    writer = PredictionWriter(output, cfg.id_start, cfg.id_name, cfg.prob_name)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads if cfg.threads is not None else max(1, (os.cpu_count() or 2) // 2))
    try:
        with progress:
            for logits, _ in logit_blocks():
                writer.write(torch.sigmoid(logits))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - t0
    say(console, f"{writer.rows:,} rows of {what} in {seconds:.1f} s "
                  f"({writer.rows / max(seconds, 1e-9):,.0f} rows/s), tables {loaded.tables.precision} on "
                 f"{next(loaded.tables.buffers()).device}, model on {loaded.device}", "predict:")
    say(console, f"wrote {writer.output}")
    return {"rows": writer.rows, "seconds": seconds}


EXAMPLES = ("recsys predict checkpoint=outputs/run input=test.txt output=preds.csv id_start=60000000",
            "recsys predict checkpoint=outputs/run input=data/kaggle split=test output=preds.csv")


def run_predict(overrides: list[str]) -> None:
    if wants_help(overrides):
        print(help_text("predict", __doc__ or "", EXAMPLES, schema=PredictConfig))
        return
    predict(parse_options(PredictConfig, overrides, "predict", (CONVERT_RENAMED,)))
