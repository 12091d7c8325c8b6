"""Streams, events and page-locked memory, with a CPU twin of each.

Code that orders work between the host, a copy stream and the compute
stream is written once against `Runtime`: `CudaRuntime` hands out CUDA
streams, timing events and pinned memory; `HostRuntime` (CPU) hands out
objects with the same methods that do the work at once, in program order,
so the ordering code runs, and is tested, on every machine. Tests pass a
recording runtime to check the order (a wait before every read of a copy,
a staging buffer never rewritten before its copy is done).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import threading
import time
import types
from collections import Counter

import torch

from recsys_cli.errors import UserError


class HostEvent:
    """torch.cuda.Event's interface on the host: work before record() is done
    when it returns, so waiting costs nothing; the timing is the host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.time: float | None = None

    def record(self, stream=None) -> None:
        self.time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "HostEvent") -> float:
        """Milliseconds from this event to `end`, as CUDA events report it."""
        if self.time is None or end.time is None:  # as torch.cuda.Event refuses it
            raise RuntimeError("elapsed_time between events not both recorded")
        return (end.time - self.time) * 1000.0


class HostStream:
    """torch.cuda.Stream's interface on the host: one in-order queue."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


COPY_KINDS = ("host_to_device_pinned", "host_to_device_pageable", "device_to_host_pinned",
              "device_to_host_pageable")


class HostRuntime:
    """The CPU twin: one stream, events on the host clock, no pinning.

    Every copy between host and device goes through to_device / to_host (or
    PinnedStaging, which counts through them): `copies` counts them by
    direction and by whether the host side was page-locked (a pageable one is
    synchronous on CUDA), so 0 pageable copies means none. Counted where host
    and device memory differ (pins_host: CUDA, and the recording runtime of
    the tests, which stands in for it); on CPU there are no copies."""

    pins_host = False  # whether host memory the device reads should be page-locked

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._stream = HostStream()
        self.copies = dict.fromkeys(COPY_KINDS, 0)
        self.copy_bytes = {"host_to_device": 0, "device_to_host": 0}  # what the copies moved, by direction
        # where each pageable copy was made ("file:line function" of the caller): what to fix, in summary.json
        self.pageable_sites: Counter[str] = Counter()

    def count_copy(self, direction: str, host_side: torch.Tensor) -> None:
        """One copy (direction "host_to_device" or "device_to_host") whose host tensor is `host_side`."""
        if self.pins_host:
            pinned = self.is_pinned(host_side)
            self.copies[f"{direction}_{'pinned' if pinned else 'pageable'}"] += 1
            self.copy_bytes[direction] += host_side.numel() * host_side.element_size()
            if not pinned:
                self.pageable_sites[f"{direction} {_caller()}"] += 1

    def to_device(self, tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """`tensor` on the device, asynchronously when it is pinned; counted when it was on the host."""
        if tensor.device.type == "cpu":
            self.count_copy("host_to_device", tensor)
        return tensor.to(device or self.device, non_blocking=True)

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`tensor` (device) on the host: into `out` (pinned: asynchronous, valid
        once an event recorded after it is done), else a new (pageable,
        synchronous) tensor; counted."""
        if out is None:
            result = tensor.to("cpu")
            self.count_copy("device_to_host", result)
            return result
        self.count_copy("device_to_host", out)
        return out.copy_(tensor, non_blocking=True)

    def event(self, timing: bool = False):
        return HostEvent(timing)

    def recorded(self, stream=None, timing: bool = False):
        """A new event, already recorded on `stream` (default: the current one).
        Publish an event another thread waits on only in this state: one
        assigned first and recorded after may be read in between, and a wait
        on an event never recorded waits for nothing."""
        event = self.event(timing)
        event.record(self.current_stream() if stream is None else stream)
        return event

    def new_stream(self):
        return self._stream

    def current_stream(self):
        return self._stream

    def use_stream(self, stream):
        """Context in which enqueued work goes to `stream`."""
        return contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the allocator `tensor` is used on `stream` (memory made on another)."""

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return True  # nothing to pin: host memory is the device's memory

    def empty_pinned(self, shape, dtype=torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def allocated(self) -> dict[str, int] | None:
        """Bytes the allocators hold now and at their peak: device memory and
        pinned host memory (None on CPU, where the process's RSS is the measure)."""
        return None

    def device_view(self, host: torch.Tensor) -> torch.Tensor | None:
        """`host` (page-locked, from empty_pinned) as a device tensor over the
        same memory, no copy: the device's kernels read and write the host
        pages over the bus (placement=uvm). None where there is no such view
        (CPU: host memory is the device's memory already)."""
        return None


class _LockedPages(mmap.mmap):
    """Anonymous pages locked for the device while this object lives: its
    finalizer unregisters them before mmap unmaps them. A tensor made with
    torch.frombuffer holds a reference to it, so the pages stay registered as
    long as any view of the tensor lives."""

    def __new__(cls, length: int, registry: "RegisteredHostMemory"):
        return super().__new__(cls, -1, length)

    def __init__(self, length: int, registry: "RegisteredHostMemory") -> None:
        self.registry = registry
        self.length = length
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self))
        registry.register(self.address, length)

    def __del__(self) -> None:
        self.registry.unregister(self.address, self.length)


class RegisteredHostMemory:
    """Page-locked host memory of the size asked for. torch's caching host
    allocator (pin_memory=True) rounds every block up to the next power of
    two, so a 2.16 GB host table would lock 4 GiB; here the tensor lives in
    anonymous pages of its own size (rounded to a page) that are registered
    with the driver (cudaHostRegister) and unregistered when the last view of
    the tensor dies. `register(address, bytes)` and `unregister(address)`
    are the driver calls (tests pass recording ones); the bytes registered
    now and at the peak are counted here, since the caching allocator's
    stats do not see them."""

    def __init__(self, register, unregister) -> None:
        self._register, self._unregister = register, unregister
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def empty(self, shape, dtype=torch.float32) -> torch.Tensor:
        shape = tuple(shape) if not isinstance(shape, int) else (shape,)
        count = 1
        for n in shape:
            count *= n
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        pages = _LockedPages(length, self)
        return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)

    def register(self, address: int, length: int) -> None:
        self._register(address, length)
        with self._lock:
            self.current += length
            self.peak = max(self.peak, self.current)

    def unregister(self, address: int, length: int) -> None:
        self._unregister(address)
        with self._lock:
            self.current -= length


CUDA_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: the pages in the device's address space too (UVM)


def _cuda_host_register(address: int, length: int) -> None:
    # Mapped, so a uvm table's kernels can address the pages (device_view);
    # a device that cannot map host memory still gets them page-locked.
    err = torch.cuda.cudart().cudaHostRegister(address, length, CUDA_HOST_REGISTER_MAPPED)
    if int(err) != 0:
        err = torch.cuda.cudart().cudaHostRegister(address, length, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {length} bytes failed: {err}")


def _cuda_host_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


_registered: RegisteredHostMemory | None = None


def registered_host_memory() -> RegisteredHostMemory:
    """The process's registered pinned memory (CUDA runs)."""
    global _registered
    if _registered is None:
        _registered = RegisteredHostMemory(_cuda_host_register, _cuda_host_unregister)
    return _registered


class CudaRuntime(HostRuntime):
    pins_host = True
    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def empty_pinned(self, shape, dtype=torch.float32) -> torch.Tensor:
        """Page-locked memory of this size, not a power of two (RegisteredHostMemory)."""
        return registered_host_memory().empty(shape, dtype)

    def device_view(self, host: torch.Tensor) -> torch.Tensor | None:
        if host.numel() == 0:
            return torch.empty(host.shape, dtype=host.dtype, device=self.device)
        if not host.is_contiguous():
            return None
        pointer = mapped_device_pointer(host.data_ptr(), self.device)
        if pointer is None:
            return None
        view = torch.as_tensor(_MappedHostArray(host, pointer), device=self.device)
        # as_tensor would copy rather than fail if it could not take the
        # memory as it is; a copy is not a view
        return view if view.data_ptr() == pointer else None

    def allocated(self) -> dict[str, int]:
        host = torch.cuda.host_memory_stats()  # pin_memory()'s blocks (batches)
        registered = registered_host_memory()  # empty_pinned's pages (tables, staging buffers)
        return {
            "device": torch.cuda.memory_allocated(self.device),
            "device_peak": torch.cuda.max_memory_allocated(self.device),
            "pinned_host": host.get("active_bytes.current", 0) + registered.current,
            # the sum of the two peaks: at least the peak of the sum
            "pinned_host_peak": host.get("active_bytes.peak", 0) + registered.peak,
        }


_TYPESTR = {torch.float32: "<f4", torch.float16: "<f2", torch.int8: "|i1", torch.uint8: "|u1",
            torch.int64: "<i8", torch.int32: "<i4"}


class _MappedHostArray:
    """A device pointer to page-locked host memory, in the CUDA array
    interface that torch.as_tensor takes without copying; it holds the host
    tensor, so the pages (and their registration) live as long as the
    device tensor made from it."""

    def __init__(self, host: torch.Tensor, pointer: int) -> None:
        self.host = host
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": _TYPESTR[host.dtype],
                                         "data": (pointer, False), "version": 2, "strides": None}


CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
_libcuda: ctypes.CDLL | None = None


def mapped_device_pointer(address: int, device: torch.device) -> int | None:
    """The device's address of registered host memory at `address`
    (cuMemHostGetDevicePointer, the CUDA driver's), or the host address
    itself where the device says it can use that (unified addressing,
    CanUseHostPointerForRegisteredMem); None when neither holds."""
    global _libcuda
    try:
        _libcuda = _libcuda or ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    torch.cuda.synchronize(device)  # the runtime's primary context current on this thread, for the driver calls
    pointer = ctypes.c_uint64()
    if _libcuda.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), ctypes.c_void_p(address), 0) == 0:
        return pointer.value
    usable = ctypes.c_int()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _libcuda.cuDeviceGetAttribute(ctypes.byref(usable), CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                                     index) == 0 and usable.value:
        return address
    return None


def allocated_by(runtime: HostRuntime, build):
    """(build(), the bytes it left allocated per tier: device, pinned_host),
    read from the allocators; the bytes are None on CPU."""
    before = runtime.allocated()
    result = build()
    after = runtime.allocated()
    if before is None or after is None:
        return result, None
    return result, {tier: after[tier] - before[tier] for tier in ("device", "pinned_host")}


def with_index(device: torch.device | str) -> torch.device:
    """`device` naming its index: `cuda` is the current GPU. Tensors on `cuda`
    and `cuda:0` live on one GPU, but the two devices compare unequal, so
    every "is this tensor where the table is?" must see one spelling."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def parse_device(name: str, key: str = "trainer.device") -> torch.device:
    """A device option as written (auto, cpu, cuda, cuda:N) as a device, with
    no index chosen: auto is cuda when a GPU is present, else cpu. Anything
    else is a one-line UserError naming the option, `key`."""
    name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise UserError(f"{key}={name} is not a device: give auto, cpu, cuda or cuda:N")
    return device


def resolve_device(name: str, one_of_many: bool = False, key: str = "trainer.device") -> torch.device:
    """The device this process trains on, always with its index: tensors on
    `cuda` and `cuda:0` are on the same GPU, but the devices compare unequal,
    so code that asks "is this tensor where the table is?" must see one
    spelling. A single process on cuda:N makes N the current device (the
    streams and the caching allocator follow it). `one_of_many`: this process
    is one rank of several, each on the GPU its launcher selected
    (torch.cuda.current_device(), set from its local rank), so naming one
    GPU for all of them is refused. `key`: the option's name in errors."""
    device = parse_device(name, key)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise UserError(f"{key}={name} but no CUDA device is available (use {key}=auto or cpu)")
    if one_of_many:
        if device.index is not None:
            raise UserError(one_gpu_for_many(name))
        return torch.device("cuda", torch.cuda.current_device())
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise UserError(f"{key}={name} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def one_gpu_for_many(name: str) -> str:
    return (f"trainer.device={name} names one GPU, but several processes train one GPU each (rank r takes "
            "cuda:<local rank>): use trainer.device=cuda, or one process")


def has_bf16_path(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively here: on CUDA the device
    says so; on CPU oneDNN needs AVX512-BF16 or AMX (without them autocast
    still runs, emulated and slower than fp32, which no user asks for)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def require_dense_precision(precision: str, device: torch.device) -> None:
    """UserError for model.dense_precision=bf16 on a device without a bf16 path."""
    if precision == "bf16" and not has_bf16_path(device):
        raise UserError(f"model.dense_precision=bf16 but {device.type} here has no bf16 matrix path "
                        "(CPUs need AVX512-BF16 or AMX; CUDA GPUs compute capability 8.0+): use model.dense_precision=fp32")


def runtime_for(device: torch.device | str) -> HostRuntime:
    device = torch.device(device)
    return CudaRuntime(device) if device.type == "cuda" else HostRuntime(device)


class PinnedStaging:
    """A reusable page-locked buffer that host rows are gathered into before
    an asynchronous copy to the device. A non_blocking copy from pageable
    memory is synchronous, and a fresh pinned tensor per step costs a
    cudaHostAlloc; one buffer that grows (x1.5) to the largest request is
    reused. Rewriting it while the previous copy still reads it would corrupt
    that copy, so take() first waits on the event recorded after it (`done`)."""

    def __init__(self, runtime: HostRuntime, dim: int, dtype=torch.float32) -> None:
        self.runtime = runtime
        self.dim = dim
        self.dtype = dtype
        self.buffer: torch.Tensor | None = None
        self._copied = None  # event after the last copy out of the buffer
        self.allocations = 0

    def take(self, rows: int) -> torch.Tensor:
        """A [rows, dim] view of the buffer, safe to write."""
        if self._copied is not None:
            self._copied.synchronize()  # usually long done: the copy was enqueued a step ago
            self._copied = None
        if self.buffer is None or self.buffer.shape[0] < rows:
            capacity = max(rows, int(1.5 * (0 if self.buffer is None else self.buffer.shape[0])))
            self.buffer = self.runtime.empty_pinned((capacity, self.dim), self.dtype)
            self.allocations += 1
        return self.buffer[:rows]

    def to_device(self, view: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Copy a view from take() to the device on the current stream; the
        buffer may be rewritten once that copy is done."""
        self.runtime.count_copy("host_to_device", view)
        out = view.to(device, non_blocking=True, copy=True)  # copy: on CPU too, never an alias of the buffer
        self._copied = self.runtime.recorded()
        return out

    def from_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of the buffer that `tensor` (device) is copied into on the
        current stream, asynchronously: read it only once an event recorded
        after this is done. Valid until the next take()."""
        return self.runtime.to_host(tensor, out=self.take(tensor.shape[0]))


def _caller() -> str:
    """The first frame outside this module and transfer.py: who asked for the copy."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.endswith(("device.py", "transfer.py")):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"


def pageable_sites(runtimes) -> dict[str, int]:
    """Where the pageable copies of several runtimes were made, most first."""
    total: Counter[str] = Counter()
    for r in {id(r): r for r in runtimes if r is not None}.values():
        total.update(r.pageable_sites)
    return dict(total.most_common())


def sum_copies(runtimes) -> dict[str, int]:
    """The copy counts of several runtimes (each counted once), kind by kind."""
    unique = {id(r): r for r in runtimes if r is not None}.values()
    return {kind: sum(r.copies[kind] for r in unique) for kind in COPY_KINDS}
