"""Batches from the host to the device: pinned on the loader thread, copied on a copy stream.

A non_blocking copy from pageable memory is synchronous, so on CUDA the
loader's transform pins every tensor the step will copy (the batch and its
lookup plans) while it still runs ahead of the trainer. The trainer then
copies a batch on its own copy stream, not the compute stream: enqueued as
soon as the previous step's kernels are (the host runs ahead of the device),
batch i+1's copy runs while the device still computes step i instead of
queueing behind it, as TorchRec's train pipeline does. The compute stream
waits on the copy's event before the first kernel that reads the batch, and
the copies are marked as used on the compute stream so the allocator does
not hand their memory back to the copy stream early.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recsys_cli.data.batch import Batch
from recsys_cli.device import HostRuntime, runtime_for


def pinning(runtime: HostRuntime) -> Callable[[Batch], Batch]:
    """A loader transform: the batch and its plans in page-locked memory."""
    return lambda batch: batch.pin_memory(runtime.pin)


class BatchCopier:
    """Moves batches to the device on a copy stream (a pass-through on CPU)."""

    def __init__(self, device: torch.device, runtime: HostRuntime | None = None) -> None:
        self.device = device
        self.runtime = runtime or runtime_for(device)
        self.stream = self.runtime.new_stream() if device.type != "cpu" else None
        self.pageable_copies = 0  # host tensors copied without being pinned first (0 on a pinned pipeline)

    def to_device(self, batch: Batch) -> Batch:
        if self.stream is None:
            return batch
        rt, copies = self.runtime, []

        def move(t: torch.Tensor) -> torch.Tensor:
            if not rt.is_pinned(t):
                self.pageable_copies += 1
            rt.count_copy("host_to_device", t)  # with every other copy of the run (summary.json)
            out = t.to(self.device, non_blocking=True)
            copies.append(out)
            return out

        with rt.use_stream(self.stream):
            moved = batch.to(self.device, move=move)
            copied = rt.recorded(self.stream)
        compute = rt.current_stream()
        compute.wait_event(copied)
        for t in copies:
            rt.record_stream(t, compute)
        return moved
