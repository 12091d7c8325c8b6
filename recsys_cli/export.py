"""`recsys export checkpoint=RUN_OR_FILE [convert=fp32|fp16|int8|int4] [format=pt2|module] [output=FILE] [vocab=DIR]`

An inference artifact that holds the MLPs, every table and the dataset's
mapping of raw values to ids, so it scores raw Criteo fields. Two formats:

  format=pt2 (default; RUN/model-<precision>.pt2): one self-contained
    torch.export program, loadable with torch alone and usable by
    torch.export tooling (AOTInductor, ...):

        import torch
        model = torch.export.load("model-int8.pt2").module()

  format=module (RUN/model-<precision>.scorer.pt): one torch.save file of
    plain values and tensors (torch.load(weights_only=True) reads it; no
    pickled code): the same metadata, what rebuilds the scoring module
    (the DLRM's shapes, the tables in `convert`'s precision, the mapping) and its
    state dict. The fastest to load (torch.export's reader is not
    imported), but it needs recsys installed: the module is rebuilt from
    recsys's own classes.

`load_scorer` loads either (BENCHMARKS.md, "Export: seconds to load"):

    from recsys_cli.export import load_scorer
    model = load_scorer("model-int8.scorer.pt")  # a .pt2: load_scorer(path, trust_program=True)
    p = model(dense, categorical)  # [B] click probabilities
    # dense: int64 [B, 13], I1..I13 as written (missing -> 0)
    # categorical: int64 [B, 26], C1..C26 as the uint32 their 8 hex digits spell (missing -> -1)

Both score alike bit for bit (tested). load_scorer checks every record's
CRC-32 first: a damaged file is an error naming it.

Trust (issue 40): a format=module artifact is data (safe_load.py reads it
with weights_only=True: a file holding anything else is refused, one line).
A .pt2 is a program: torch.export.load(path).module() runs what the file
holds (its guards are Python code .module() execs, its symbolic shapes go
through sympy's eval on load, some members are unpickled in full), so
load_scorer on a .pt2 trusts the file; share format=module artifacts with
people who should not have to.
load_metadata reads either without running anything (a .pt2's metadata
straight from its archive). No recsys command reads a .pt2.

`raw_inputs(lines)` turns TSV lines into those two tensors. Inside the
program the dense values go through preprocessing's transform (log1p of
max(x, 0) in float64, rounded to float32: data_tools/criteo_text.py) and
the categorical values through the dataset's mapping: vocabulary mode, one
binary search over the saved sorted values (0 for values without an id and
for missing ones); hashing mode, 1 + value % (buckets - 1), 0 for missing;
a dataset without raw values (synthetic) takes its ids as they are (missing
or -1 -> 0; an id past its table is an error naming the feature: a
ValueError, or the program's RuntimeError). An fp32 artifact scores raw rows bit for bit like `recsys
predict` on them at the same batch size and thread count (tested).

Tables are stored in `convert`'s precision (converted from the checkpoint's, by
nearest rounding when going down): fp32 and fp16 rows, or int8 / int4 codes
with one fp16 scale and bias per row (FBGEMM's fused inference rows: value =
code * scale + bias; int4 packs two codes a byte). fp32 from an fp32 run
scores bit for bit like the checkpoint. The program's metadata
(`extra_files["recsys.json"]`) names the features, their vocabulary sizes,
the precision, the mapping and the dataset vocabulary's fingerprint;
format=module carries the same dict (`load_metadata` reads either).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar

import torch
from torch import nn

from recsys_cli.errors import UserError, say
from recsys_cli.locks import check_not_read, check_writable, locked_output
from recsys_cli.options import CONVERT_RENAMED, help_text, parse_options, require, wants_help

if TYPE_CHECKING:  # at run time imported where they are used, as before
    from recsys_cli.inference import InferenceTables
    from recsys_cli.model.dlrm import DLRM

METADATA = "recsys.json"
M = TypeVar("M", bound=nn.Module)
SCORER_FORMAT = "recsys scorer 1"  # format=module's record
FORMATS = {"pt2": ".pt2", "module": ".scorer.pt"}  # format -> the default output's suffix


@dataclass
class ExportConfig:
    checkpoint: Optional[str] = None  # a .pt file, a checkpoint directory or a run directory (required)
    # The tables' precision in the artifact: fp32 | fp16 | int8 | int4 (a plain string, checked by
    # export(): recsys_cli.config's choices would import Hydra into load_scorer's readers).
    convert: str = "fp32"
    format: str = "pt2"  # pt2: one torch.export program, torch alone loads it | module: fastest load, needs recsys
    # The file to write (default: <run dir>/model-<precision>.pt2; format=module: .scorer.pt).
    output: Optional[str] = None
    vocab: Optional[str] = None  # dataset whose vocabulary maps raw values (default: the training dataset's)


def dense_log1p(raw: torch.Tensor) -> torch.Tensor:
    """torch twin of data_tools.criteo_text.dense_log1p (float64, rounded once):
    the same float32 for every integer (tests/test_predict.py)."""
    return torch.log1p(raw.clamp(min=0).to(torch.float64)).to(torch.float32)


class RawIds(nn.Module):
    """categorical int64 [B, F] (raw uint32 values, -1 = missing) -> ids int64 [B, F],
    as preprocessing maps them (data_tools/vocab.py).

    mode "vocabulary": every feature's sorted values in one buffer, feature f's
    offset by f * 2^32 so that one searchsorted finds all; a value without an
    id, missing (-1) or outside uint32 gets 0. mode "hash": 1 + value % (buckets - 1),
    missing 0. mode "ids": the values are the dataset's ids (missing -> 0)."""

    keys: torch.Tensor  # buffers (vocabulary mode)
    ids: torch.Tensor
    offsets: torch.Tensor

    def __init__(self, mode: str, num_features: int, tables=None, hash_buckets: int | None = None,
                 buffers: dict[str, torch.Tensor] | None = None) -> None:
        """vocabulary mode: from data_tools.vocab's `tables`, or `buffers`
        (keys, ids, offsets) as a module-format artifact saved them."""
        super().__init__()
        self.mode = mode
        self.num_features = num_features
        self.hash_buckets = hash_buckets
        if mode == "vocabulary" and buffers is not None:
            for name in ("keys", "ids", "offsets"):
                self.register_buffer(name, buffers[name])
        elif mode == "vocabulary":
            import numpy as np

            keys = [np.asarray(t.values, dtype=np.int64) + (f << 32) for f, t in enumerate(tables)]
            ids = [np.asarray(t.ids, dtype=np.int64) for t in tables]
            # a sentinel above every key keeps positions in range without a clamp
            self.register_buffer("keys", torch.from_numpy(np.concatenate([*keys, [num_features << 32]])))
            self.register_buffer("ids", torch.from_numpy(np.concatenate([*ids, [0]])))
            self.register_buffer("offsets", torch.arange(num_features, dtype=torch.int64) << 32)

    def forward(self, categorical: torch.Tensor) -> torch.Tensor:
        if self.mode == "ids":
            return categorical.clamp(min=0)
        present = categorical >= 0
        if self.mode == "hash":
            assert self.hash_buckets is not None, "hash mode is made with its bucket count"
            return torch.where(present, categorical.remainder(self.hash_buckets - 1) + 1, 0)
        present = present & (categorical < (1 << 32))
        keys = torch.where(present, categorical, 0) + self.offsets  # below the sentinel: positions in range
        pos = torch.searchsorted(self.keys, keys)
        hit = present & (self.keys[pos] == keys)
        return torch.where(hit, self.ids[pos], 0)


class ScoringModule(nn.Module):
    """(dense int64 [B, 13], categorical int64 [B, F]) raw -> click probabilities [B]."""

    def __init__(self, dlrm: DLRM[InferenceTables], raw_ids: RawIds) -> None:
        super().__init__()
        self.dlrm = dlrm
        self.raw_ids = raw_ids

    def forward(self, dense: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        tables = self.dlrm.embeddings
        ids = self.raw_ids(categorical)
        if self.raw_ids.mode == "ids":  # the other mappings give ids of the tables by construction
            check_ids_in_tables(ids, tables.features, tables.num_rows)
        return torch.sigmoid(self.dlrm.dense_forward(dense_log1p(dense), tables.pool_onehot(ids)))


def check_ids_in_tables(ids: torch.Tensor, features: list[str], num_rows: list[int]) -> None:
    """ids int64 [B, F] (negative ones already 0: missing) against each
    feature's table, as the training loader checks a dataset's ids: an id past
    a table is an error naming the feature, where indexing would fail with a
    bare IndexError. Eager (format=module): a ValueError naming the id too. In
    a torch.export program a message cannot hold a value from the data: one
    runtime assertion per feature, naming it and its table's rows."""
    if torch.compiler.is_exporting():
        for f, (name, rows) in enumerate(zip(features, num_rows)):
            torch._assert_async((ids[:, f] < rows).all(),
                                f"categorical {name}: an id outside [0, {rows}) (the table's rows)")
        return
    past = ids >= torch.tensor(num_rows, dtype=ids.dtype, device=ids.device)
    if bool(past.any()):
        row, f = (int(i) for i in past.nonzero()[0])
        raise ValueError(f"categorical {features[f]}: id {int(ids[row, f])} (row {row}) is outside "
                         f"[0, {num_rows[f]}) (the table's rows)")


def raw_ids_of(loaded, vocab_dir: str | None) -> RawIds:
    """The mapping of the checkpoint's dataset (or vocab=DIR), checked against the checkpoint."""
    from data_tools.manifest import ManifestError, load_manifest
    from recsys_cli.predict import training_vocabulary

    num = len(loaded.features)
    source = Path(vocab_dir).expanduser() if vocab_dir else loaded.dataset_dir
    if source is not None and not vocab_dir:
        try:
            if "vocabulary" not in load_manifest(source).options:  # synthetic: ids, no raw values
                return RawIds("ids", num)
        except ManifestError:
            pass  # training_vocabulary says what is wrong
    vocabulary = training_vocabulary(loaded, vocab_dir)
    if vocabulary.mode == "hash":
        return RawIds("hash", num, hash_buckets=int(vocabulary.hash_buckets))
    return RawIds("vocabulary", num, vocabulary.tables)


def scoring_module(loaded, raw_ids: RawIds) -> ScoringModule:
    """The checkpoint's model and the mapping as one inference module."""
    # A checkpoint's tables are views of one flat storage; saved as they are,
    # torch.export.save warns ("No complete tensor found in the group ...
    # weights not on CPU") for each, and torch.save would write the whole
    # storage. Each table gets a storage of its own.
    tables = loaded.tables
    for name, buf in list(tables.named_buffers()):
        if buf.untyped_storage().nbytes() != buf.numel() * buf.element_size():
            setattr(tables, name, buf.clone())
    return _inference(ScoringModule(loaded.model, raw_ids))


def _inference(module: M) -> M:
    module.eval()
    for p in module.parameters():  # an inference module: no autograd graph on its outputs
        p.requires_grad_(False)
    return module


def export_program(loaded, raw_ids: RawIds) -> torch.export.ExportedProgram:
    from torch.export import Dim

    module = scoring_module(loaded, raw_ids)
    num_dense = loaded.model.bottom[0].in_features
    example = (torch.zeros(4, num_dense, dtype=torch.int64),
               torch.zeros(4, len(loaded.tables.features), dtype=torch.int64))
    batch = Dim("batch", min=1, max=1 << 24)
    with torch.no_grad():
        return torch.export.export(module, example, dynamic_shapes=({0: batch}, {0: batch}), strict=False)


def raw_inputs(lines) -> tuple[torch.Tensor, torch.Tensor]:
    """Criteo TSV lines (str or bytes; 40 fields, or 39 without the label)
    -> (dense int64 [B, 13], categorical int64 [B, 26]), an artifact's inputs,
    parsed as `recsys preprocess` parses them; ValueError naming the first
    bad line (its 1-based position in `lines`) and column. Each item is one
    line, with or without its LF or CRLF, and gives one row: an empty item is
    a bad line (skipping it would shift every later row against its input)."""
    import numpy as np

    from data_tools.criteo_text import (NUM_COLUMNS, NUM_SPARSE, UNLABELLED_SCORED, BadBlock, BlockParser,
                                        diagnose_line, strip_cr)

    # (1-based position in `lines`, the line without its LF: a CR before it is
    # left for the parser, which takes CRLF and refuses any other CR)
    numbered = []
    for i, ln in enumerate(lines, 1):
        ln = ln.encode() if isinstance(ln, str) else bytes(ln)
        if i == 1 and ln.startswith(b"\xef\xbb\xbf"):  # a byte order mark starting the file: dropped, as preprocess does
            ln = ln[3:]
        numbered.append((i, ln[:-1] if ln.endswith(b"\n") else ln))
    if not numbered:
        return torch.zeros(0, 13, dtype=torch.int64), torch.zeros(0, NUM_SPARSE, dtype=torch.int64)
    # Labelled or not: the first line that has fields (an empty one is refused below, by its position).
    first = next((strip_cr(ln) for _, ln in numbered if strip_cr(ln)), b"")
    labels = first.count(b"\t") + 1 == NUM_COLUMNS
    parser = BlockParser(labels=labels)

    def parse(k: int):
        """The first k lines, parsed; BadBlock unless each is one good row."""
        d = parser.parse(b"\n".join(ln for _, ln in numbered[:k]) + b"\n", want_dense=True)
        if d.rows != k:
            raise BadBlock("row count")
        return d

    try:
        d = parse(len(numbered))
    except BadBlock:
        # The first bad line, by bisection with the parser itself (what it
        # accepts decides, as in preprocess): the shortest failing prefix.
        lo, hi = 0, len(numbered)  # the first lo lines parse; the first hi do not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            try:
                parse(mid)
                lo = mid
            except BadBlock:
                hi = mid
        i, ln = numbered[hi - 1]
        raise ValueError(f"line {i}: {diagnose_line(strip_cr(ln), False, labels, UNLABELLED_SCORED)}") from None
    categorical = np.full((d.rows, NUM_SPARSE), -1, dtype=np.int64)
    for f in range(NUM_SPARSE):
        categorical[d.present[f], f] = d.values[f]
    return torch.from_numpy(d.dense_raw.copy()), torch.from_numpy(categorical)


def export(cfg: ExportConfig, console=None) -> dict:
    with contextlib.ExitStack() as hold:  # the output's lock, once the output is known (locks.py)
        return _export(cfg, console, hold)


def _export(cfg: ExportConfig, console, hold: contextlib.ExitStack) -> dict:
    from rich.console import Console

    from recsys_cli.inference import INFERENCE_PRECISIONS, load_model

    console = console or Console(stderr=True, highlight=False)
    checkpoint = require(cfg.checkpoint, "checkpoint", "export", "a run directory or a .pt file")
    if cfg.convert not in INFERENCE_PRECISIONS:
        raise UserError(f"convert={cfg.convert!r} is not one of {', '.join(INFERENCE_PRECISIONS)}")
    if cfg.format not in FORMATS:
        raise UserError(f"format={cfg.format!r} is not one of {', '.join(FORMATS)}")
    if cfg.output:  # an unwritable output is said before the checkpoint loads
        check_writable(Path(cfg.output), "output")
    with _phase(console, f"export: loading {cfg.checkpoint}", f"export: loaded {cfg.checkpoint}"):
        loaded = load_model(checkpoint, device="cpu", precision=cfg.convert)
    multi_hot = _multi_hot(loaded)
    if multi_hot:
        raise UserError(f"export scores one-hot features only; {loaded.checkpoint} has multi-hot features "
                        f"{', '.join(multi_hot)}")
    run_dir = loaded.checkpoint.parent.parent if loaded.checkpoint.parent.name == "checkpoints" else loaded.checkpoint.parent
    suffix = FORMATS[cfg.format]
    output = Path(cfg.output).expanduser() if cfg.output else run_dir / f"model-{cfg.convert}{suffix}"
    if output.is_dir():
        raise UserError(f"output {output} is a directory; give a file name (e.g. {output}/model{suffix})")
    hold.enter_context(locked_output(output, "output", "export"))  # one writer; an unwritable place said now
    read = [("checkpoint", loaded.checkpoint)]
    vocab_source = Path(cfg.vocab) if cfg.vocab else loaded.dataset_dir
    check_not_read(output, read + ([("vocabulary dataset", vocab_source)] if vocab_source else []), "export")
    raw_ids = raw_ids_of(loaded, cfg.vocab)
    if cfg.format == "pt2":
        with _phase(console, "export: tracing the model (torch.export)", "export: traced the model with torch.export"):
            program = export_program(loaded, raw_ids)
    meta: dict[str, Any] = {
        "format": "recsys export 2",
        "inputs": {"dense": "int64 [B, 13]: I1..I13 as written, missing -> 0",
                   "categorical": ("int64 [B, F]: C1..C26 as the uint32 their hex digits spell, missing -> -1"
                                   if raw_ids.mode != "ids" else "int64 [B, F]: the dataset's ids, missing -> 0")},
        "mapping": raw_ids.mode,
        "returns": "float32 [B]: click probability",
        "features": loaded.features,
        "precision": cfg.convert,
        "table_bytes": loaded.tables.nbytes(),
        "checkpoint": str(loaded.checkpoint),
        "step": loaded.state.get("step"),
        "vocabulary": loaded.vocabulary_fingerprint,
        "dataset_dir": str(loaded.dataset_dir) if loaded.dataset_dir else None,
    }
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {output.parent}: {e.strerror or e}") from None
    # written in a temporary directory under its final name (the archive's
    # folder is named after the file), then renamed into place
    tmp_dir = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    tmp_dir.mkdir(exist_ok=True)
    tmp = tmp_dir / (output.stem + ".pt2" if cfg.format == "pt2" else output.name)
    try:
        with _phase(console, f"export: writing {output}", f"export: wrote {output}"):
            if cfg.format == "pt2":
                torch.export.save(program, tmp, extra_files={METADATA: json.dumps(meta)})
            else:
                torch.save(scorer_record(loaded, raw_ids, meta), tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_dir.rmdir()
    size = output.stat().st_size
    how = ("torch.export.load(path).module()" if cfg.format == "pt2"
           else "recsys_cli.export.load_scorer(path)")
    say(console, f"{output} ({size / 2**20:,.2f} MiB; tables {cfg.convert} "
                 f"{meta['table_bytes'] / 2**20:,.2f} MiB), load with {how}", "export:")
    return {"output": str(output), "bytes": size, **meta}


def scorer_record(loaded, raw_ids: RawIds, meta: dict) -> dict:
    """format=module: what torch.save writes. Plain values and tensors only
    (torch.load(weights_only=True) reads it; no pickled code): the
    metadata, what rebuilds the ScoringModule from this package's classes,
    and its state dict."""
    from recsys_cli.inference import dlrm_spec

    module = scoring_module(loaded, raw_ids)
    return {
        "format": SCORER_FORMAT,
        "metadata": meta,
        "dlrm": dlrm_spec(loaded.config["model"], int(loaded.model.bottom[0].in_features)),
        "tables": loaded.tables.spec(),
        "raw_ids": {"mode": raw_ids.mode, "num_features": raw_ids.num_features, "hash_buckets": raw_ids.hash_buckets},
        "state_dict": dict(module.state_dict()),
    }


@contextlib.contextmanager
def _phase(console, doing: str, done: str):
    """A spinner saying what the export is doing on a terminal; in a log, a
    line with its seconds once it is done (an error stays the only line)."""
    started = time.perf_counter()
    with console.status(doing) if console.is_terminal else contextlib.nullcontext():
        yield
    if not console.is_terminal:
        console.print(f"{done} ({time.perf_counter() - started:.1f} s)", soft_wrap=True, markup=False)


def _multi_hot(loaded) -> list[str]:
    from data_tools.manifest import ManifestError, load_manifest

    if loaded.dataset_dir is None:
        return []
    try:
        return [f.name for f in load_manifest(loaded.dataset_dir).sparse_features if f.multi_hot]
    except ManifestError:
        return []


def artifact_format(path: str | Path) -> str:
    """"pt2" or "module", told from the file's contents after checking every
    record's CRC-32 (both formats are zip archives that carry one per
    record; torch's readers do not check them): a damaged, truncated or
    foreign file is a UserError naming it."""
    import zipfile

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"export artifact {path} " + ("is not a file" if path.exists() else "does not exist"))
    what = "a recsys export artifact (.pt2 or format=module)"
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise UserError(f"{path} is damaged or not {what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        ) from None
    if bad is not None:
        raise UserError(f"{path} is damaged: record {bad} fails its CRC-32")
    if any(n.count("/") == 1 and n.endswith("/archive_format") for n in names):
        return "pt2"
    if any(n.count("/") == 1 and n.endswith("/data.pkl") for n in names):
        return "module"
    raise UserError(f"{path} is not {what}")


def _read_scorer(path: Path) -> dict:
    from recsys_cli import safe_load

    record = safe_load.torch_file(path, "export artifact")  # weights_only: code in it is refused, never run
    if not isinstance(record, dict) or record.get("format") != SCORER_FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise UserError(f"{path} is not a recsys scorer ({SCORER_FORMAT!r} expected, found {found!r})")
    return record


def load_scorer(path: str | Path, *, trust_program: bool = False) -> nn.Module:
    """An artifact of either format as a module: `load_scorer(path)(dense,
    categorical)` -> click probabilities [B]. format=module rebuilds
    ScoringModule (this file's RawIds, inference.py's InferenceTables, the
    DLRM) from its record, without importing torch.export's reader; one that
    holds anything but plain data is refused (safe_load.UnsafeFile). A .pt2
    is a program: torch.export.load runs code it holds (see above), so it is
    loaded (torch.export.load(path).module()) only with trust_program=True,
    the caller's word that the file comes from someone they trust; without
    it, a one-line UserError. Damaged or foreign files: a one-line UserError
    naming the file."""
    path = Path(path).expanduser()
    if artifact_format(path) == "pt2":
        if not trust_program:
            raise UserError(f"{path} is a torch.export program, whose loading runs code it holds: "
                            "load_scorer(path, trust_program=True) for a file you trust, or export it "
                            "with format=module (plain data)")
        try:
            return torch.export.load(path).module()
        except Exception as e:
            raise UserError(f"cannot read {path}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    from recsys_cli.inference import InferenceTables, build_dlrm

    record = _read_scorer(path)
    try:
        state = record["state_dict"]
        table_prefix, raw_prefix = "dlrm.embeddings.", "raw_ids."
        tables = InferenceTables.from_buffers(
            record["tables"], {k[len(table_prefix):]: v for k, v in state.items() if k.startswith(table_prefix)})
        r = record["raw_ids"]
        raw_ids = RawIds(r["mode"], int(r["num_features"]), hash_buckets=r["hash_buckets"],
                         buffers={k[len(raw_prefix):]: v for k, v in state.items() if k.startswith(raw_prefix)}
                         if r["mode"] == "vocabulary" else None)
        module = ScoringModule(build_dlrm(tables, record["dlrm"]), raw_ids)
        module.load_state_dict(state, strict=True, assign=True)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{path}: the scorer's record does not rebuild its model "
                        f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
    return _inference(module)


def load_metadata(path: str | Path) -> dict:
    """The artifact's metadata (either format)."""
    path = Path(path).expanduser()
    if artifact_format(path) == "module":
        meta = _read_scorer(path).get("metadata")
        if not isinstance(meta, dict):  # was a KeyError's traceback
            raise UserError(f"{path} holds no recsys metadata (its record's 'metadata'): not a recsys export artifact")
        return meta
    # Read from the archive itself, not through torch.export.load: that
    # deserializes the program, which runs what the file holds (its guards'
    # code, sympy expressions, pickles): metadata never needs that.
    import zipfile

    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.count("/") == 2 and n.split("/", 1)[1] == f"extra/{METADATA}"]
        if not names:
            raise UserError(f"{path} holds no recsys metadata (extra/{METADATA}): not a recsys export artifact")
        try:
            return json.loads(z.read(names[0]))
        except ValueError as e:
            raise UserError(f"{path}: its extra/{METADATA} is not JSON ({e})") from None


EXAMPLES = ("recsys export checkpoint=outputs/run",
            "recsys export checkpoint=outputs/run convert=int8 format=module output=model.scorer.pt")


def run_export(overrides: list[str]) -> None:
    if wants_help(overrides):
        print(help_text("export", __doc__ or "", EXAMPLES, schema=ExportConfig))
        return
    export(parse_options(ExportConfig, overrides, "export", (CONVERT_RENAMED,)))
