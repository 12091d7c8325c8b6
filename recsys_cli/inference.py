"""A trained model for scoring: a checkpoint's MLPs and tables, no optimizer, no cache.

`load_model(checkpoint)` rebuilds the run's DLRM with `InferenceTables` in
place of the training EmbeddingBagCollection: every table as saved (its
training precision, or one chosen for export), read by one gather and the
same dequantization training uses (quant.py), pooled by sum. For fp32
tables a logit is bit for bit the trainer's evaluation logit of the same
row at the same batch size: the gathered rows are the same numbers and the
MLPs are the same modules.

`predict`, `evaluate` and `export` (recsys_cli/predict.py, evaluate.py,
export.py) all score through this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from recsys_cli.data.batch import Batch
from recsys_cli.data.jagged import KeyedJaggedTensor
from recsys_cli.embeddings.quant import dequantize_rows, quantize_rows
from recsys_cli.errors import UserError

if TYPE_CHECKING:  # at run time imported where a model is built (build_dlrm), as before
    from recsys_cli.model.dlrm import DLRM

INFERENCE_PRECISIONS = ("fp32", "fp16", "int8", "int4")


def convert_table(saved: dict, precision: str) -> dict[str, torch.Tensor]:
    """A checkpoint table (its precision's tensors) in `precision`: fp32
    `weights`, fp16 `weights`, or int `codes` + fp16 `scale_bias` (per-row
    scale and bias, FBGEMM's layout; int4 packs two codes a byte). Converting
    down rounds to nearest; a table already in `precision` is kept as is."""
    if saved["precision"] == precision:
        return {k: v for k, v in saved.items() if k in ("weights", "codes", "scale_bias")}
    fp32 = table_fp32(saved)
    if precision == "fp32":
        return {"weights": fp32}
    if precision == "fp16":
        return {"weights": fp32.half()}
    bits = int(precision[3:])
    if bits == 4 and fp32.shape[1] % 2:
        raise UserError(f"int4 tables need an even embedding dim, got {fp32.shape[1]}")
    codes, scale_bias = [], []
    for start in range(0, fp32.shape[0], 1 << 18):  # bounded temporaries on big tables
        c, sb = quantize_rows(fp32[start:start + (1 << 18)], bits, "nearest")
        codes.append(c)
        scale_bias.append(sb)
    return {"codes": torch.cat(codes), "scale_bias": torch.cat(scale_bias)}


def table_fp32(saved: dict) -> torch.Tensor:
    if saved["precision"] == "fp32":
        return saved["weights"]
    if saved["precision"] == "fp16":
        return saved["weights"].float()
    return dequantize_rows(saved["codes"], saved["scale_bias"], int(saved["precision"][3:]))


class InferenceTables(nn.Module):
    """One table per sparse feature in one precision, on `device` (or kept
    in host memory with table_device=cpu: rows are gathered there and copied)."""

    def __init__(self, features: list[str], tables: list[dict[str, torch.Tensor]], precision: str,
                 dim: int) -> None:
        super().__init__()
        self.features = list(features)
        self.precision = precision
        self.bits = int(precision[3:]) if precision.startswith("int") else 0
        self.dim = dim
        self.num_rows = [int(next(iter(t.values())).shape[0]) for t in tables]
        for i, t in enumerate(tables):
            for name, tensor in t.items():
                self.register_buffer(f"{name}_{i}", tensor.contiguous())

    def table(self, i: int) -> list[torch.Tensor]:
        if self.bits:
            return [getattr(self, f"codes_{i}"), getattr(self, f"scale_bias_{i}")]
        return [getattr(self, f"weights_{i}")]

    def rows(self, i: int, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` of table i, as training reads them."""
        t = self.table(i)
        ids = ids.to(t[0].device)
        # Advanced indexing, not index_select: the same copy, but index_select's
        # parallel CPU kernel costs milliseconds a call when the cores are busy
        # (measured: 9 ms vs 0.06 ms for 4096 rows on 2 loaded cores).
        if self.bits:
            return dequantize_rows(t[0][ids], t[1][ids], self.bits)
        rows = t[0][ids]
        return rows.float() if self.precision == "fp16" else rows

    def pool_onehot(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [B, F] (one id per feature) -> pooled [B, F, D]."""
        parts = [self.rows(i, ids[:, i]) for i in range(len(self.features))]
        return torch.stack(parts, dim=1)

    def forward(self, batch: Batch) -> torch.Tensor:
        sparse = batch.sparse
        if not isinstance(sparse, KeyedJaggedTensor):
            raise TypeError("InferenceTables takes a KeyedJaggedTensor batch (no dedup)")
        if sparse.keys != self.features:
            raise UserError(f"batch features {sparse.keys} differ from the model's {self.features}")
        B, num = sparse.stride, len(self.features)
        lengths = sparse.lengths.view(num, B)
        out_device = batch.dense.device
        if bool((lengths == 1).all()):
            ids = sparse.values.view(num, B)
            return torch.stack([self.rows(i, ids[i]).to(out_device) for i in range(num)], dim=1)
        per_key = lengths.sum(1).tolist()
        values = torch.split(sparse.values, per_key)
        parts = []
        for i in range(num):
            rows = self.rows(i, values[i]).to(out_device)
            offsets = torch.zeros(B, dtype=torch.int64, device=out_device)
            torch.cumsum(lengths[i, :-1].to(out_device), 0, out=offsets[1:])
            positions = torch.arange(rows.shape[0], device=out_device)
            parts.append(F.embedding_bag(positions, rows, offsets, mode="sum"))  # training's pooling order
        return torch.stack(parts, dim=1)

    def spec(self) -> dict:
        """What rebuilds these tables with from_buffers (plain values)."""
        return {"features": list(self.features), "precision": self.precision, "dim": self.dim}

    @classmethod
    def from_buffers(cls, spec: dict, buffers: dict[str, torch.Tensor]) -> "InferenceTables":
        """Tables of `spec` from their buffers as named in a state dict
        (weights_0, or codes_0 + scale_bias_0, ...)."""
        names = ("codes", "scale_bias") if spec["precision"].startswith("int") else ("weights",)
        tables = [{n: buffers[f"{n}_{i}"] for n in names} for i in range(len(spec["features"]))]
        return cls(spec["features"], tables, spec["precision"], int(spec["dim"]))

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


@dataclass
class LoadedModel:
    model: DLRM[InferenceTables]  # in eval mode
    tables: InferenceTables
    checkpoint: Path
    state: dict  # the checkpoint without its tensors (config, features, dataset, vocabulary)
    device: torch.device

    @property
    def config(self) -> dict:
        return self.state["config"]

    @property
    def features(self) -> dict[str, int]:
        return self.state["features"]

    @property
    def dataset_dir(self) -> Path | None:
        d = self.state.get("dataset_dir")
        return Path(d) if d else None

    @property
    def vocabulary_fingerprint(self) -> str | None:
        return self.state.get("vocabulary")

    @torch.no_grad()
    def logits(self, batch: Batch) -> torch.Tensor:
        batch = batch if self.device.type == "cpu" else batch.to(self.device, non_blocking=True)
        return self.model(batch).float()

    @torch.no_grad()
    def logits_onehot(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """dense float32 [B, 13], ids int64 [B, F]."""
        dense = dense.to(self.device, non_blocking=True)
        pooled = self.tables.pool_onehot(ids).to(self.device, non_blocking=True)
        return self.model.dense_forward(dense, pooled).float()


def load_model(location: str | Path, device: str = "auto", precision: str | None = None,
               table_device: str | None = None) -> LoadedModel:
    """The checkpoint at `location` (a .pt file or a run/checkpoint directory)
    ready to score. precision: the tables' precision (default: as trained;
    tables trained in different precisions by placement=auto are all
    converted to the lowest-bit one only when asked). table_device: where
    the tables live (default: the device, except tables trained in host
    memory, which stay on the host when the device is a GPU)."""
    from recsys_cli.embeddings.disk_checkpoint import materialize
    from recsys_cli import checkpoints as ckpt
    from recsys_cli import determinism
    from recsys_cli.device import resolve_device

    determinism.settle_vector_math()  # before the scores' first parallel op
    path = find_run_checkpoint(location)
    state = ckpt.load_checkpoint(path)
    for key in ("model", "tables", "features", "config"):
        if key not in state:
            raise UserError(f"{path} is not a recsys training checkpoint (no {key!r})")
    dev = resolve_device(device, key="device")  # predict and evaluate spell it device=
    cfg = state["config"]
    features = list(state["features"])
    saved = [materialize(state["tables"][f]) for f in features]  # a disk table: read whole from its files
    trained = {s["precision"] for s in saved}
    if precision is None:
        if len(trained) > 1:  # placement=auto: fp32 device tables beside low-precision ones
            raise UserError(f"{path}: tables were trained in {sorted(trained)}; give precision=fp32 (exact) "
                            "or one of " + ", ".join(INFERENCE_PRECISIONS))
        precision = trained.pop()
    if precision not in INFERENCE_PRECISIONS:
        raise UserError(f"precision={precision!r} is not one of {', '.join(INFERENCE_PRECISIONS)}")
    tables = InferenceTables(features, [convert_table(s, precision) for s in saved], precision,
                             int(cfg["model"]["embedding_dim"]))
    model = build_dlrm(tables, dlrm_spec(cfg["model"], int(state["model"]["bottom.0.weight"].shape[1])))
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if not k.startswith("embeddings.")]
    if missing or unexpected:
        raise UserError(f"{path}: the model's weights do not match its config (missing {missing}, "
                        f"unexpected {unexpected})")
    tiers = state.get("table_tiers", {})
    host = table_device == "cpu" or (table_device is None and dev.type == "cuda"
                                     and any(tiers.get(f) == "host" for f in features))
    model.to(dev)
    if host:
        tables.to(torch.device("cpu"))
    model.eval()
    info = {k: v for k, v in state.items() if k not in ("model", "tables", "dense_optimizer", "generators",
                                                        "torch_rng")}
    return LoadedModel(model, tables, path, info, dev)


def dlrm_spec(model_cfg, num_dense: int) -> dict:
    """What rebuilds a run's DLRM around inference tables (plain values: an
    export's module format saves it)."""
    m = model_cfg
    return {"num_dense": num_dense, "bottom_mlp": [int(x) for x in m["bottom_mlp"]],
            "top_mlp": [int(x) for x in m["top_mlp"]], "interaction": str(m["interaction"]),
            "dcn_layers": int(m.get("dcn_layers", 3)), "dcn_rank": int(m.get("dcn_rank", 512))}


def build_dlrm(tables: InferenceTables, spec: dict) -> DLRM[InferenceTables]:
    """The DLRM of `spec` (dlrm_spec) over `tables`, its MLP weights to be
    replaced by a checkpoint's. The constructor's initialisation (init="torch")
    draws from a forked RNG: loading a model leaves torch's global RNG as it was."""
    from recsys_cli.model.dlrm import DLRM

    with torch.random.fork_rng(devices=[]):
        return DLRM(spec["num_dense"], tables, list(spec["bottom_mlp"]), list(spec["top_mlp"]),
                    spec["interaction"], init="torch", dcn_layers=spec["dcn_layers"], dcn_rank=spec["dcn_rank"])


def find_run_checkpoint(location: str | Path) -> Path:
    """A .pt file, a checkpoint directory, or a run directory (its checkpoints/)."""
    from recsys_cli import checkpoints as ckpt

    location = Path(location).expanduser()
    if not location.exists():
        raise UserError(f"checkpoint {location} does not exist")
    if location.is_dir() and not (location / ckpt.LATEST).is_file() and (location / "checkpoints").is_dir():
        location = location / "checkpoints"
    return ckpt.find_checkpoint(location)
