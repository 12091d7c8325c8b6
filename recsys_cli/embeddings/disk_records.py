"""RecordCodec: a disk row store's fixed-size records, one per row.

A record is a row's native fields in its precision (fp32/fp16 weights, or
int8/int4 codes with their fp16 scale and bias), then its fp32 optimizer
state, as raw bytes. The disk store (disk_store.py) and its checkpoints
(disk_checkpoint.py) both read and write records; this module is the one
definition of their layout and depends only on quant.py.
"""

from __future__ import annotations

import torch

from recsys_cli.embeddings.quant import empty_rows


class RecordCodec:
    """Rows in one precision (plus state) <-> fixed-size byte records."""

    def __init__(self, dim: int, precision: str, rounding: str, state_width: int) -> None:
        self.dim, self.precision, self.rounding, self.state_width = dim, precision, rounding, state_width
        self.rows = empty_rows(0, dim, precision, rounding)  # the encoder (encode uses no stored rows)
        proto = empty_rows(1, dim, precision, rounding)
        self.fields = [(name, t.dtype, t.shape[1] * t.element_size()) for name, t in proto.tensors().items()]
        self.fields.append(("state", torch.float32, state_width * 4))
        self.record_bytes = sum(nbytes for _, _, nbytes in self.fields)

    def pack(self, encoded: dict[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
        """uint8 [n, R] records of encoded rows and their state."""
        n = state.shape[0]
        parts = [({**encoded, "state": state}[name].contiguous().view(torch.uint8).reshape(n, nbytes))
                 for name, _, nbytes in self.fields]
        return torch.cat(parts, dim=1)

    def unpack(self, records: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(native fields, state) of uint8 [n, R] records (copies)."""
        out, col = {}, 0
        for name, dtype, nbytes in self.fields:
            out[name] = records[:, col:col + nbytes].contiguous().view(dtype)
            col += nbytes
        state = out.pop("state")
        return out, state

    def decode(self, encoded: dict[str, torch.Tensor]) -> torch.Tensor:
        """fp32 rows of native fields (quant.py's read on these tensors)."""
        rows = empty_rows(0, self.dim, self.precision, self.rounding)
        for name, t in encoded.items():
            setattr(rows, name, t)
        n = next(iter(encoded.values())).shape[0]
        return rows.read(torch.arange(n))
