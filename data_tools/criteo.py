"""`recsys preprocess criteo`: raw Criteo TSV -> parquet shards + manifest.

Input: Criteo's raw format (Kaggle train.txt, Terabyte day_0..day_23): one
sample a line, 40 tab-separated fields, no header: label, I1..I13 (integers,
may be negative, may be empty), C1..C26 (8 hex digits, i.e. a 32-bit hash, may
be empty). LF or CRLF line endings; plain or gzip (detected from the file's
first bytes); several files (a list or a glob, taken in natural order:
day_2 before day_10) are read as one sequence of rows. An empty line is a
bad line like any other (named, or with on_error=skip skipped and counted in
skipped_lines); the final line end of a file makes no empty line.

Ids (per sparse feature, in [0, vocab_size)):
  * vocabulary mode (default, two passes). Pass 1 counts every value's
    occurrences. Values seen at least `min_count` times are "frequent" and get
    ids 1..V-1 in order of descending count, ties broken by ascending value
    (the 32-bit number the hex digits spell). Missing values and values seen
    fewer than `min_count` times share id 0. vocab_size = V = 1 + #frequent.
    The mapping is saved with the shards (data_tools/vocab.py: vocab/*.npy,
    sorted values and their ids).
  * hashing mode (`hash_buckets=N`, N >= 2, one pass, no counting):
    id = 1 + value % (N - 1); missing -> 0; vocab_size = N for every feature.
  * existing vocabulary (`vocab=DIR`, one pass): DIR's saved mapping;
    values it has no id for -> 0, counted per feature
    (manifest.options.unknown_values); the vocabulary is copied along.
Unlabelled input (`labels=false`): 39 fields, no label; no label column.
Dense: log(1 + max(x, 0)) as float32, missing -> 0. Label: float32 (or int8
with label_dtype=int8); must be in [0, 1] (0 or 1 for int8).

Splits (rows in input order, after dropping skipped lines):
  * split_by=kaggle (default): DLRM's. 7 equal "days" (total // 7 rows each, the
    first total % 7 days one row more); train = days 0-5; the last day is
    halved as numpy.array_split does: first (larger) half test, second half val.
  * split_by=ratios split_ratios=[a,b,c]: consecutive train/val/test ranges in proportion.
  * split_by=none: one split, "all", of every row.
  In the one-pass modes the row count is known only at the end: rows are staged in
  file order and moved (or, for the at most two files that straddle a split
  boundary, rewritten) into their split.

Bad lines (wrong field count, a label that is not a number in [0, 1], a
non-integer I*, a C* that is not 8 hex digits): with on_error=raise (default)
the run stops with a UserError naming the file, the 1-based line number in
that file and the column; with on_error=skip they are dropped and counted
(manifest.skipped_lines). Integers are decimal (an optional minus, then
digits; spaces around them are allowed) and must fit int64; a hex prefix
(0x10) is a bad line, not 16. A CR is part of a line end only right before
its LF; anywhere else it is a bad line.

Hex digits may be upper or lower case.

How it runs (one concept a module): one thread reads (and gunzips) blocks of
`block_size` bytes cut at line ends and another parses them
(data_tools/criteo_input.py); parsing, the vectorised checks and hex decoding
are data_tools/criteo_text.py; with workers > 1 that runs in worker processes
(data_tools/criteo_workers.py), each block handed over in shared memory
(data_tools/block_slots.py). The main thread (this module: the passes)
counts values in vectorised open-addressing hash tables (data_tools/u32map.py,
one per feature, uint32 keys), so memory grows with the number of distinct
values, not with rows. With spill=true (default) pass 1 also writes the parsed
rows, with each value replaced by its first-seen index, to an Arrow file
inside the temporary output directory (about 160 bytes a row); pass 2 maps
those indices to ids with one array lookup and writes the shards, without
parsing the text again. spill=false re-reads and re-parses the input in pass 2
instead.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from data_tools import dataset_dir
from data_tools import vocab as vocab_io
from data_tools.criteo_config import CriteoConfig, output_dir, validate
from data_tools.criteo_days import describe as describe_days
from data_tools.criteo_days import terabyte_days
from data_tools.criteo_input import BlockReader, resolve_inputs
from data_tools.criteo_passes import mapped_mode, vocabulary_mode
from data_tools.errors import UserError, say
from data_tools.manifest import CRITEO_SPARSE, Manifest, SparseFeature

__all__ = ["CriteoConfig", "preprocess"]


class _Progress:
    def __init__(self, enabled: bool, total_bytes: int):
        self.p = None
        self.total = total_bytes
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        console = Console(stderr=True)
        if not console.is_terminal:
            return
        self.p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[rows]:>12,} rows  {task.fields[rate]:>9,.0f} rows/s"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )

    def __enter__(self):
        if self.p is not None:
            self.p.start()
        return self

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.stop()
        return False

    def task(self, name: str):
        t0 = time.perf_counter()
        p = self.p
        if p is None:
            return lambda rows, nbytes: None
        tid = p.add_task(name, total=self.total, rows=0, rate=0.0)

        def update(rows: int, nbytes: int) -> None:
            dt = max(time.perf_counter() - t0, 1e-9)
            p.update(tid, completed=nbytes, rows=rows, rate=rows / dt)

        return update


def preprocess(cfg: CriteoConfig, *, console=None) -> Manifest:
    """Run the preprocessing described by `cfg`; returns the manifest written."""
    from rich.console import Console

    if isinstance(cfg.input, tuple):
        cfg = dataclasses.replace(cfg, input=list(cfg.input))
    validate(cfg)
    console = console or Console(stderr=True, highlight=False)
    paths = resolve_inputs(cfg.input)
    output = output_dir(cfg)
    for p in paths:  # it would be read while its directory is replaced
        if output.resolve() in p.resolve().parents:
            raise UserError(f"input {p} is inside the output directory {output}; write the dataset elsewhere")
    days = terabyte_days(paths) if cfg.split_by == "terabyte" else None
    dataset_dir.check_output(output.absolute())
    source_vocab = _source_vocabulary(cfg)
    total_bytes = sum(p.stat().st_size for p in paths)
    t0 = time.perf_counter()
    reader = BlockReader(paths, labels=cfg.labels, label_int8=cfg.label_dtype == "int8",
                         block_size=cfg.block_size, on_error=cfg.on_error)
    timings: dict[str, float] = {}
    unknown: dict[str, int] | None = None
    with _Progress(cfg.progress, total_bytes) as progress, dataset_dir.atomic_dataset_dir(output) as tmp:
        distinct: dict[str, int] | None = None
        given = _given_mapping(cfg, source_vocab, tmp)
        if given is None:
            features, splits, skipped, distinct, vocab_entry = vocabulary_mode(
                cfg, reader, paths, tmp, progress, timings, t0)
        else:
            vocabulary, features, vocab_entry = given
            splits, skipped, unseen = mapped_mode(cfg, reader, paths, tmp, progress, vocabulary, features)
            if source_vocab is not None:
                unknown = dict(zip(CRITEO_SPARSE, map(int, unseen)))
        seconds = time.perf_counter() - t0
        if "pass 1" in timings:
            timings["pass 2"] = seconds - timings["pass 1"]
        # what does not change the output stays out of it: the same dataset whatever the workers or budget
        options = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("progress", "workers", "memory_budget")}
        options["input"] = [str(p) for p in paths]
        options["mode"] = "hash" if vocab_entry["mode"] == "hash" else "vocabulary"
        if days is not None:
            options["terabyte_days"] = days
        options["vocabulary"] = vocab_entry
        if distinct is not None:
            options["distinct_values"] = distinct
        if unknown is not None:
            # present values the vocabulary has no id for (unseen in training, or rarer than its min_count)
            options["unknown_values"] = unknown
        manifest = Manifest(
            source="criteo",
            sparse_features=features,
            splits=splits,
            options=options,
            inputs=[{"path": str(p), "bytes": p.stat().st_size} for p in paths],
            skipped_lines=int(skipped),
            labelled=cfg.labels,
        )
        manifest.save(tmp)
    _summary(console, manifest, output, seconds, timings)
    return manifest


def _source_vocabulary(cfg: CriteoConfig) -> tuple[vocab_io.Vocabulary, list[SparseFeature], Path] | None:
    """vocab=DIR: (the vocabulary, DIR's sparse features, DIR), checked; else None."""
    if cfg.vocab is None:
        return None
    from data_tools.manifest import ManifestError, load_manifest

    source = Path(cfg.vocab).expanduser()
    try:
        vocabulary = vocab_io.load_vocabulary(source)
        features = load_manifest(source).sparse_features
    except ManifestError as e:
        raise UserError(f"vocab={cfg.vocab}: {e}") from None
    if vocabulary.features != CRITEO_SPARSE:
        raise UserError(f"vocab={cfg.vocab}: its features {vocabulary.features} are not Criteo's C1..C26")
    return vocabulary, features, source


def _given_mapping(cfg: CriteoConfig, source_vocab: tuple[vocab_io.Vocabulary, list[SparseFeature], Path] | None,
                   tmp: Path) -> tuple[vocab_io.Vocabulary, list[SparseFeature], dict] | None:
    """The mapping the data are written with when it is not built from them
    (vocab=DIR, copied into tmp, or hash_buckets=N): (the vocabulary, the
    sparse features, the manifest's vocabulary entry); None otherwise."""
    if source_vocab is not None:
        vocabulary, features, source = source_vocab
        entry = {**vocab_io.copy_vocabulary(source, tmp), "source": str(source.absolute())}
        return vocabulary, features, entry
    if cfg.hash_buckets is not None:
        buckets = int(cfg.hash_buckets)
        features = [SparseFeature(n, buckets) for n in CRITEO_SPARSE]
        vocabulary = vocab_io.Vocabulary(CRITEO_SPARSE, "hash", hash_buckets=buckets)
        entry = {"mode": "hash", "hash_buckets": buckets, "features": CRITEO_SPARSE,
                 "fingerprint": vocab_io.hash_fingerprint(CRITEO_SPARSE, buckets)}
        return vocabulary, features, entry
    return None


def _summary(console, m: Manifest, output: Path, seconds: float, timings: dict[str, float]) -> None:
    total = sum(s.rows for s in m.splits.values())
    rate = total / max(seconds, 1e-9)
    splits = ", ".join(f"{k} {v.rows:,}" for k, v in m.splits.items())
    vocab = " ".join(f"{f.name}={f.vocab_size:,}" for f in m.sparse_features)
    say(
        console, f"{total:,} rows ({splits}) in {seconds:.1f} s, {rate:,.0f} rows/s"
        + (f", {m.skipped_lines:,} bad lines skipped" if m.skipped_lines else "")
        + (" (" + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()) + ")" if timings else ""), "criteo:",
    )
    if "terabyte_days" in m.options:
        say(console, describe_days(m.options["terabyte_days"]))
    say(console, f"vocabulary: {vocab}")
    entry = m.options.get("vocabulary", {})
    if entry.get("mode") == "vocabulary":
        where = f"copied from {entry['source']}" if "source" in entry else f"{vocab_io.VOCAB_DIR}/"
        say(console, f"saved vocabulary: {sum(e['size'] for e in entry['files'].values()):,} values, "
                      f"{entry['bytes'] / 2**20:,.1f} MiB ({where})")
    unknown = m.options.get("unknown_values")
    if unknown:
        say(console, f"values without an id (-> 0): {sum(unknown.values()):,} "
                      f"(most in {max(unknown, key=unknown.get)}: {max(unknown.values()):,})")
    say(console, f"wrote {output}")
