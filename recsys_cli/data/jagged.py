"""KeyedJaggedTensor: the sparse half of a batch.

Layout follows TorchRec: for F keys and batch size B, ``lengths`` has F * B
entries, key-major (all samples of key 0, then key 1, ...), and ``values`` holds
the ids in the same order. A one-hot feature has length 1 everywhere; a
multi-hot feature (a history list) has any length, zero included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class KeyedJaggedTensor:
    keys: list[str]
    values: torch.Tensor  # int64 [sum(lengths)]
    lengths: torch.Tensor  # int64 [F * B]
    stride: int  # B

    def __post_init__(self) -> None:
        if self.lengths.numel() != len(self.keys) * self.stride:
            raise ValueError(
                f"lengths has {self.lengths.numel()} entries, expected "
                f"{len(self.keys)} keys x {self.stride} samples"
            )

    @classmethod
    def from_lists(cls, per_key: dict[str, list[list[int]]]) -> "KeyedJaggedTensor":
        """Build from {key: [ids of sample 0, ids of sample 1, ...]} (tests, examples)."""
        keys = list(per_key)
        stride = len(per_key[keys[0]]) if keys else 0
        values, lengths = [], []
        for k in keys:
            bags = per_key[k]
            if len(bags) != stride:
                raise ValueError(f"key {k} has {len(bags)} samples, expected {stride}")
            for bag in bags:
                values.extend(bag)
                lengths.append(len(bag))
        return cls(
            keys=keys,
            values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int64),
            stride=stride,
        )

    def offsets(self) -> torch.Tensor:
        """Start of every bag, plus the end: [F * B + 1]."""
        out = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64, device=self.lengths.device)
        torch.cumsum(self.lengths, 0, out=out[1:])
        return out

    def length_per_key(self) -> list[int]:
        return self.lengths.view(len(self.keys), self.stride).sum(1).tolist()

    def to_dict(self) -> dict[str, list[list[int]]]:
        """The inverse of from_lists (tests, debugging)."""
        out: dict[str, list[list[int]]] = {}
        offsets = self.offsets().tolist()
        values = self.values.tolist()
        for f, k in enumerate(self.keys):
            out[k] = [
                values[offsets[f * self.stride + b] : offsets[f * self.stride + b + 1]]
                for b in range(self.stride)
            ]
        return out

    def apply(self, fn) -> "KeyedJaggedTensor":
        """The same batch with fn applied to every tensor (a move, pinning)."""
        return KeyedJaggedTensor(self.keys, fn(self.values), fn(self.lengths), self.stride)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "KeyedJaggedTensor":
        return self.apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "KeyedJaggedTensor":
        return self.apply(torch.Tensor.pin_memory)


def take_bags(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Select/permute the bags of a jagged array (numpy, on the loader thread):
    (offsets [len(rows) + 1] of the taken bags, their values as int64)."""
    lengths = (offsets[1:] - offsets[:-1])[rows]
    new_off = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_off[1:])
    total = int(new_off[-1])
    idx = np.repeat(offsets[:-1][rows].astype(np.int64) - new_off[:-1], lengths)
    idx += np.arange(total, dtype=np.int64)
    return new_off, values[idx].astype(np.int64, copy=False)
