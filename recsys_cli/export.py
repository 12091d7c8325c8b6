"""`recsys export checkpoint=RUN_OR_FILE [precision=fp32|fp16|int8|int4] [output=model.pt2]`

A self-contained inference artifact: one torch.export program (.pt2) that
holds the MLPs and every table, loadable with torch alone:

    import torch
    model = torch.export.load("model-int8.pt2").module()
    dense = torch.log1p(torch.tensor(raw_I1_to_I13, dtype=torch.float32).clamp(min=0))  # [B, 13]
    ids = torch.tensor(ids_C1_to_C26)  # [B, 26] int64, the dataset's ids (vocab/*.npy; 0 = unknown)
    p = model(dense, ids)  # [B] click probabilities

Tables are stored in `precision` (converted from the checkpoint's, by
nearest rounding when going down): fp32 and fp16 rows, or int8 / int4 codes
with one fp16 scale and bias per row (FBGEMM's fused inference rows: value =
code * scale + bias; int4 packs two codes a byte). fp32 from an fp32 run
scores bit for bit like the checkpoint. The program's metadata
(`extra_files["recsys.json"]`) names the features, their vocabulary sizes,
the precision and the dataset vocabulary's fingerprint.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from recsys_cli.errors import UserError
from recsys_cli.options import help_text, parse_options, require

METADATA = "recsys.json"


@dataclass
class ExportConfig:
    checkpoint: Optional[str] = None
    precision: str = "fp32"  # fp32 | fp16 | int8 | int4
    output: Optional[str] = None  # default: <run dir>/model-<precision>.pt2


class ScoringModule(nn.Module):
    """(dense float32 [B, 13], ids int64 [B, F]) -> click probabilities [B]."""

    def __init__(self, dlrm: nn.Module) -> None:
        super().__init__()
        self.dlrm = dlrm

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pooled = self.dlrm.embeddings.pool_onehot(ids)
        return torch.sigmoid(self.dlrm.dense_forward(dense, pooled))


def export_program(loaded) -> torch.export.ExportedProgram:
    from torch.export import Dim

    model = loaded.model
    # A checkpoint's tables are views of one flat storage; saved as they are,
    # torch.export.save warns ("No complete tensor found in the group ...
    # weights not on CPU") for each. Each table gets a storage of its own.
    tables = loaded.tables
    for name, buf in list(tables.named_buffers()):
        if buf.untyped_storage().nbytes() != buf.numel() * buf.element_size():
            setattr(tables, name, buf.clone())
    module = ScoringModule(model).eval()
    for p in module.parameters():  # an inference program: no autograd graph on its outputs
        p.requires_grad_(False)
    num_dense = loaded.model.bottom[0].in_features
    example = (torch.zeros(4, num_dense), torch.zeros(4, len(loaded.tables.features), dtype=torch.int64))
    batch = Dim("batch", min=1, max=1 << 24)
    with torch.no_grad():
        return torch.export.export(module, example, dynamic_shapes=({0: batch}, {0: batch}), strict=False)


def export(cfg: ExportConfig, console=None) -> dict:
    from rich.console import Console

    from recsys_cli.inference import INFERENCE_PRECISIONS, load_model

    console = console or Console(stderr=True, highlight=False)
    require(cfg.checkpoint, "checkpoint", "export", "a run directory or a .pt file")
    if cfg.precision not in INFERENCE_PRECISIONS:
        raise UserError(f"precision={cfg.precision!r} is not one of {', '.join(INFERENCE_PRECISIONS)}")
    with _phase(console, f"export: loading {cfg.checkpoint}", f"export: loaded {cfg.checkpoint}"):
        loaded = load_model(cfg.checkpoint, device="cpu", precision=cfg.precision)
    multi_hot = _multi_hot(loaded)
    if multi_hot:
        raise UserError(f"export scores one-hot features only; {loaded.checkpoint} has multi-hot features "
                        f"{', '.join(multi_hot)}")
    run_dir = loaded.checkpoint.parent.parent if loaded.checkpoint.parent.name == "checkpoints" else loaded.checkpoint.parent
    output = Path(cfg.output).expanduser() if cfg.output else run_dir / f"model-{cfg.precision}.pt2"
    if output.is_dir():
        raise UserError(f"output {output} is a directory; give a file name (e.g. {output}/model.pt2)")
    with _phase(console, "export: tracing the model (torch.export)", "export: traced the model with torch.export"):
        program = export_program(loaded)
    meta = {
        "format": "recsys export 1",
        "inputs": {"dense": "float32 [B, 13]: log(1 + max(x, 0)) of I1..I13, missing -> 0",
                   "ids": "int64 [B, F]: per feature the dataset vocabulary's id (0 = missing or unknown)"},
        "returns": "float32 [B]: click probability",
        "features": loaded.features,
        "precision": cfg.precision,
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
    tmp = tmp_dir / (output.stem + ".pt2")
    try:
        with _phase(console, f"export: writing {output}", f"export: wrote {output}"):
            torch.export.save(program, tmp, extra_files={METADATA: json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_dir.rmdir()
    size = output.stat().st_size
    console.print(f"[bold]export[/]: {output} ({size / 2**20:,.2f} MiB; tables {cfg.precision} "
                  f"{meta['table_bytes'] / 2**20:,.2f} MiB), load with torch.export.load(path).module()")
    return {"output": str(output), "bytes": size, **meta}


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


def load_metadata(path: str | Path) -> dict:
    extra = {METADATA: ""}
    torch.export.load(path, extra_files=extra)
    return json.loads(extra[METADATA])


def run_export(overrides: list[str]) -> None:
    if any(o in ("-h", "--help") for o in overrides):
        print(help_text(ExportConfig, "export", __doc__))
        return
    export(parse_options(ExportConfig, overrides, "export"))
