"""The CUDA paths' ordering, checked on CPU through a recording runtime: the
phase timer never waits for the device while a step runs, batches are
pinned before they are copied on the copy stream and the compute stream
waits for the copy, and a staging buffer is reused and never rewritten
before its copy is done."""

from __future__ import annotations

import contextlib

import pytest
import torch
from devices import TEST_DEVICE
from embedding_harness import FEATURES, VOCAB, build, make_batches

from recsys_cli.data.batch import Batch
from recsys_cli.data.dedup import dedup_kjt
from recsys_cli.device import HostRuntime
from recsys_cli.train.metrics import PhaseTimer
from recsys_cli.train.transfer import BatchCopier, pinning

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)


class Clock:
    now = 0.0


class RecordingEvent:
    def __init__(self, runtime: "RecordingRuntime", name: str) -> None:
        self.runtime, self.name, self.time, self.stream = runtime, name, None, None

    def record(self, stream=None) -> None:
        self.time, self.stream = Clock.now, stream
        self.runtime.log.append(("record", self.name, stream))

    def synchronize(self) -> None:
        self.runtime.log.append(("synchronize", self.name))

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "RecordingEvent") -> float:
        return (end.time - self.time) * 1000.0


class RecordingStream:
    def __init__(self, runtime: "RecordingRuntime", name: str) -> None:
        self.runtime, self.name = runtime, name

    def wait_event(self, event) -> None:
        self.runtime.log.append(("wait", self.name, event.name))

    def wait_stream(self, stream) -> None:
        self.runtime.log.append(("wait_stream", self.name, stream.name))

    def synchronize(self) -> None:
        self.runtime.log.append(("stream_synchronize", self.name))

    def __repr__(self) -> str:
        return self.name


class RecordingRuntime(HostRuntime):
    """A runtime that logs what a CUDA runtime would be asked to do; pinning
    marks tensors (by storage) so a copy from unpinned memory is visible."""

    def __init__(self, device="cpu") -> None:
        super().__init__(device)
        self.log: list = []
        self.compute = RecordingStream(self, "compute")
        self.streams = 0
        self.active = self.compute
        self.pinned: set[int] = set()
        self.events = 0

    def event(self, timing: bool = False):
        self.events += 1
        return RecordingEvent(self, f"e{self.events}")

    def new_stream(self):
        self.streams += 1
        return RecordingStream(self, f"side{self.streams}")

    def current_stream(self):
        return self.active

    @contextlib.contextmanager
    def use_stream(self, stream):
        previous, self.active = self.active, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.active = previous
            self.log.append(("exit", stream.name))

    def record_stream(self, tensor, stream) -> None:
        self.log.append(("record_stream", stream.name))

    pins_host = True  # it stands in for a CUDA runtime

    def pin(self, tensor):
        self.log.append(("pin", tensor.numel() * tensor.element_size()))
        out = tensor.clone()
        self.pinned.add(out.untyped_storage().data_ptr())
        return out

    def is_pinned(self, tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.pinned

    def empty_pinned(self, shape, dtype=torch.float32):
        out = torch.empty(shape, dtype=dtype)
        self.log.append(("alloc_pinned", out.numel() * out.element_size()))
        self.pinned.add(out.untyped_storage().data_ptr())
        return out


# --- phase timing ---------------------------------------------------------------
def test_phase_timer_reads_events_at_log_time_and_never_synchronizes_the_device(monkeypatch):
    def no_sync(*a, **k):
        raise AssertionError("torch.cuda.synchronize() during a step")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    runtime = RecordingRuntime()
    timer = PhaseTimer(torch.device("cpu"), runtime)
    for step in range(3):
        for name, seconds in (("embedding_forward", 0.25), ("backward", 0.5)):
            with timer.phase(name):
                Clock.now += seconds
    assert not [e for e in runtime.log if e[0] == "synchronize"]  # nothing waited while the steps ran
    assert all(e[2] is runtime.compute for e in runtime.log if e[0] == "record")
    timer.collect()
    assert [e for e in runtime.log if e[0] == "synchronize"] == [("synchronize", "e12")]  # only the last end
    assert timer.seconds == pytest.approx({"embedding_forward": 0.75, "backward": 1.5})
    with timer.phase("backward"):
        Clock.now += 0.125
    assert timer.seconds["backward"] == pytest.approx(1.625)  # reading the report collects the rest


def test_phase_timer_on_the_host_clock_measures_wall_time():
    import time

    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("data_wait"):
        time.sleep(0.02)
    # at least the sleep; the upper bound only tells seconds from milliseconds
    # (20 in ms) with room for a loaded machine that leaves the thread unscheduled
    assert 0.015 < timer.seconds["data_wait"] < 10.0


# --- batches to the device ----------------------------------------------------------
def _planned_batches(dedup: bool = False) -> tuple[list[Batch], object]:
    model, _ = build({"kind": "device"})
    batches = make_batches(3, max_len=2)
    if dedup:  # repeated bags, deduplicated: plans over unique bags
        batches = [Batch(b.dense, dedup_kjt(b.sparse), b.labels) for b in batches]
    return [model.embeddings.plan_batch(b) for b in batches], model


def _host_tensors(batch: Batch) -> list[torch.Tensor]:
    out = []
    batch.apply(lambda t: out.append(t) or t)
    for plan in batch.plans or ():
        plan.moved(lambda t: out.append(t) or t)
    return out


@pytest.mark.parametrize("dedup", [False, True])
def test_batches_are_pinned_on_the_loader_thread_and_copied_on_the_copy_stream(dedup):
    batches, _ = _planned_batches(dedup)
    runtime = RecordingRuntime("meta")  # the meta device: real moves, no memory
    copier = BatchCopier(torch.device("meta"), runtime)
    pin = pinning(runtime)
    for batch in batches:
        pinned = pin(batch)
        assert all(runtime.is_pinned(t) for t in _host_tensors(pinned))
        runtime.log.clear()
        moved = copier.to_device(pinned)
        n = len(_host_tensors(pinned))
        on_device = _host_tensors(Batch(moved.dense, moved.sparse, moved.labels))
        for plan in moved.plans:
            plan.apply(lambda t: on_device.append(t) or t)
            on_device.append(plan.unique_device)
            assert plan.unique.device.type == "cpu"  # the caches and host stores index with it
        assert len(on_device) == n and all(t.device.type == "meta" for t in on_device)
        # Copies inside the copy stream, its event recorded there, then the compute stream waits for it.
        assert runtime.log[0] == ("enter", "side1")
        record = runtime.log.index(("record", f"e{runtime.events}", copier.stream))
        assert runtime.log[record + 1] == ("exit", "side1")
        assert runtime.log[record + 2] == ("wait", "compute", f"e{runtime.events}")
        assert runtime.log[record + 3:] == [("record_stream", "compute")] * n
    assert copier.pageable_copies == 0
    copier.to_device(batches[0])  # never pinned: every copy would block
    assert copier.pageable_copies == len(_host_tensors(batches[0]))


def test_copier_is_a_pass_through_on_cpu():
    batches, _ = _planned_batches()
    assert BatchCopier(torch.device("cpu")).to_device(batches[0]) is batches[0]


def test_pinned_batches_train_like_unpinned_ones():
    """The pinned copy (and its plans) is the same batch: one step on each gives equal rows."""
    batches, model = _planned_batches(dedup=True)
    pinned = pinning(RecordingRuntime())(batches[0])
    outs = []
    for b in (batches[0], pinned):
        outs.append(model.embeddings(b))
        model.embeddings.pending().clear()
    assert torch.equal(outs[0], outs[1])


# --- the host placement's staging buffers ----------------------------------------------
def test_host_rows_are_gathered_into_one_reused_pinned_buffer_rewritten_only_after_its_copy():
    runtime = RecordingRuntime()
    reference, _ = build({"kind": "host"}, optimizer="adagrad")
    staged, _ = build({"kind": "host"}, optimizer="adagrad")
    group = staged.embeddings.groups[0]
    group.use_runtime(runtime)
    for batch in make_batches(6):
        for model in (reference, staged):
            pooled = model.embeddings(batch)
            (pooled.float() ** 2).sum().backward()
            model.embeddings.step()
    # The last step's updated rows are still on their way to the host table:
    # no step waited for them; the next reader (here a snapshot) does.
    assert group._update_in_flight is not None
    for name in FEATURES:
        assert torch.equal(staged.embeddings.table_state()[name]["weights"],
                           reference.embeddings.table_state()[name]["weights"])
    rows, state = group.staging
    assert rows.allocations <= 3 and state.allocations <= 3  # grows to the largest batch, then reused
    # Every rewrite of a buffer after the first waited on the event recorded after its last copy.
    recorded: set[str] = set()
    for entry in runtime.log:
        if entry[0] == "record":
            recorded.add(entry[1])
        if entry[0] == "synchronize":
            assert entry[1] in recorded
    syncs = sum(1 for e in runtime.log if e[0] == "synchronize")
    # rows and state buffers, every step but the first; and each step's updated
    # rows, copied off the device into pinned buffers before the host table is written
    assert syncs == 2 * 6 - 2 + 6
    assert runtime.copies == {"host_to_device_pinned": 2 * 6, "host_to_device_pageable": 0,
                              "device_to_host_pinned": 2 * 6, "device_to_host_pageable": 0}


class MappingRuntime(RecordingRuntime):
    """A recording runtime whose pinned host memory the "device" addresses
    directly (CudaRuntime.device_view's stand-in: the view is the tensor)."""

    def device_view(self, host):
        self.log.append(("device_view", host.numel() * host.element_size()))
        return host


def test_uvm_trains_with_kernels_over_host_memory_and_copies_nothing_per_step():
    """placement=uvm: the table is built once in pinned host memory and then
    addressed by the device, so a step gathers and updates rows with no
    copy (no staging, no host gather), and trains exactly as the host
    placement's copies do."""
    from omegaconf import OmegaConf

    from recsys_cli.config import PlacementConfig, PrecisionConfig
    from recsys_cli.embeddings.optim import RowOptimizer
    from recsys_cli.embeddings.placement import make_group
    from recsys_cli.embeddings.table_init import TableSpec
    from recsys_cli.embeddings.tables import DirectGroup
    from recsys_cli.errors import UserError

    specs = [TableSpec(f, v, 8) for f, v in zip(FEATURES, VOCAB)]
    prec = OmegaConf.structured(PrecisionConfig)
    groups = {}
    for kind, runtime in (("uvm", MappingRuntime()), ("host", RecordingRuntime())):
        place = OmegaConf.merge(OmegaConf.structured(PlacementConfig), {"kind": kind})
        group = make_group(kind, "fp32", specs, place, prec, RowOptimizer("adagrad", 0.1), torch.device("cpu"), 0,
                           runtime=runtime)
        group.use_runtime(runtime)
        groups[kind] = (group, runtime)
    uvm, mapping = groups["uvm"]
    assert isinstance(uvm, DirectGroup) and uvm.store.mapped and uvm.staging is None
    assert sum(e[1] for e in mapping.log if e[0] == "alloc_pinned") == uvm.store.nbytes()  # pinned, built in place
    assert sum(e[1] for e in mapping.log if e[0] == "device_view") == uvm.store.nbytes()  # then mapped, not copied
    mapping.log.clear()
    planner, _ = build({"kind": "host"})  # one group of every table, in the same fused row order
    for batch in make_batches(6):
        plan = planner.embeddings.plan_batch(batch).plans[0]
        for group, _ in groups.values():
            rows = group.gather(plan).requires_grad_()
            (rows ** 2).sum().backward()
            group.update(plan, rows.detach(), rows.grad)
    assert mapping.copies == dict.fromkeys(mapping.copies, 0)  # not one copy in six steps
    assert not [e for e in mapping.log if e[0] in ("synchronize", "alloc_pinned", "pin")]
    assert groups["host"][1].copies["host_to_device_pinned"] > 0  # the host placement copies every step
    for name in FEATURES:
        assert torch.equal(uvm.table_state()[name]["weights"], groups["host"][0].table_state()[name]["weights"])
    # a pinned runtime that cannot map host memory: refused in one line, not silently a host gather
    place = OmegaConf.merge(OmegaConf.structured(PlacementConfig), {"kind": "uvm"})
    with pytest.raises(UserError, match="cannot address host memory directly.*placement=host"):
        make_group("uvm", "fp32", specs, place, prec, RowOptimizer("adagrad", 0.1), torch.device("cpu"), 0,
                   runtime=RecordingRuntime())


def test_staging_grows_geometrically_and_hands_out_views_of_one_buffer():
    from recsys_cli.device import PinnedStaging

    staging = PinnedStaging(RecordingRuntime(), dim=4)
    first = staging.take(100)
    staging.to_device(first, torch.device("cpu"))
    again = staging.take(80)
    assert again.data_ptr() == first.data_ptr() and staging.allocations == 1
    staging.to_device(again, torch.device("cpu"))
    staging.take(120)
    assert staging.allocations == 2 and staging.buffer.shape[0] == 150
    copy = staging.to_device(staging.take(10).fill_(1.0), torch.device("cpu"))
    staging.take(10).fill_(2.0)
    assert torch.equal(copy, torch.ones(10, 4))  # a copy, never an alias of the buffer


@pytest.mark.parametrize("kind", ["host", "uvm"])
def test_device_runs_of_the_host_placement_match_cpu(kind):
    """RECSYS_TEST_DEVICE=cuda: pinned batches copied on the copy stream and
    host rows staged (host), or gathered and updated by kernels over mapped
    host memory (uvm), give the CPU's rows (to float tolerance)."""
    if TEST_DEVICE.type == "cpu":
        pytest.skip("runs with RECSYS_TEST_DEVICE=cuda (make gpu-check)")
    from omegaconf import OmegaConf

    from recsys_cli.config import PlacementConfig, PrecisionConfig
    from recsys_cli.embeddings.optim import RowOptimizer
    from recsys_cli.embeddings.placement import build_embeddings

    batches, _ = _planned_batches()
    got = []
    for device in (torch.device("cpu"), TEST_DEVICE):
        emb = build_embeddings(FEATURES, VOCAB, 8, OmegaConf.merge(OmegaConf.structured(PlacementConfig), {"kind": kind}),
                               OmegaConf.structured(PrecisionConfig), RowOptimizer("adagrad", 0.1), device, 0)
        if device.type == "cuda" and kind == "uvm":
            store = emb.groups[0].store
            assert store.mapped and store.rows.weights.device == emb.groups[0].device  # a view, no device copy
            assert emb.groups[0].runtime.copies == dict.fromkeys(emb.groups[0].runtime.copies, 0)
        copier = BatchCopier(device)
        for batch in batches:
            b = copier.to_device(pinning(copier.runtime)(batch))
            (emb(b) ** 2).sum().backward()
            emb.step()
        got.append(emb.table_state())
    assert copier.pageable_copies == 0
    for name in FEATURES:
        torch.testing.assert_close(got[1][name]["weights"], got[0][name]["weights"], rtol=1e-5, atol=1e-6)


# --- memory from the allocators ---------------------------------------------------------
def test_bytes_per_tier_come_from_the_allocators_where_there_are_any():
    from recsys_cli.device import allocated_by

    class Allocators(RecordingRuntime):
        held = {"device": 1000, "device_peak": 1000, "pinned_host": 50, "pinned_host_peak": 50}

        def allocated(self):
            return dict(self.held)

    runtime = Allocators()

    def build():
        runtime.held["device"] += 4096
        runtime.held["pinned_host"] += 123
        return "built"

    assert allocated_by(runtime, build) == ("built", {"device": 4096, "pinned_host": 123})
    assert allocated_by(HostRuntime(), lambda: "cpu") == ("cpu", None)  # CPU: RSS is the measure


@pytest.mark.parametrize("kind, precision", [("host", "fp32"), ("lookahead", "fp32"), ("cache", "int8"), ("uvm", "int4")])
def test_a_host_table_is_pinned_once_in_place_never_copied_to_pin(kind, precision):
    from omegaconf import OmegaConf

    from recsys_cli.config import PlacementConfig, PrecisionConfig
    from recsys_cli.embeddings.optim import RowOptimizer
    from recsys_cli.embeddings.placement import make_group
    from recsys_cli.embeddings.table_init import TableSpec

    specs = [TableSpec("a", 500, 8), TableSpec("b", 300, 8)]
    runtime = RecordingRuntime()
    place = OmegaConf.merge(OmegaConf.structured(PlacementConfig), {"kind": kind, "cache_rows": 100})
    prec = OmegaConf.merge(OmegaConf.structured(PrecisionConfig), {"kind": precision})
    group = make_group(kind, precision, specs, place, prec, RowOptimizer("adagrad"), torch.device("cpu"), 0,
                       runtime=runtime)
    store = group.store
    assert not [e for e in runtime.log if e[0] == "pin"]  # nothing pinned by copying
    assert sum(e[1] for e in runtime.log if e[0] == "alloc_pinned") == store.nbytes()  # exactly one copy
    assert all(runtime.is_pinned(t) for t in [*store.rows.tensors().values(), store.state])
    unpinned = make_group(kind, precision, specs, place, prec, RowOptimizer("adagrad"), torch.device("cpu"), 0)
    for k, v in unpinned.store.rows.tensors().items():  # the same table either way
        assert torch.equal(store.rows.tensors()[k], v)


# --- pinned host memory of the size asked for -------------------------------------------
class DriverLog:
    """cudaHostRegister / cudaHostUnregister stand-ins: the ranges locked now."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}
        self.seen_at_unregister: list[bytes] = []

    def register(self, address: int, length: int) -> None:
        assert address % 4096 == 0 and address not in self.locked
        self.locked[address] = length

    def unregister(self, address: int) -> None:
        import ctypes

        self.seen_at_unregister.append(ctypes.string_at(address, 4))  # still mapped when unregistered
        del self.locked[address]


def test_pinned_host_tables_lock_their_size_not_the_next_power_of_two(monkeypatch):
    import gc
    import mmap

    from omegaconf import OmegaConf

    import recsys_cli.device as device
    from recsys_cli.config import PlacementConfig, PrecisionConfig
    from recsys_cli.embeddings.optim import RowOptimizer
    from recsys_cli.embeddings.placement import make_group
    from recsys_cli.embeddings.table_init import TableSpec

    driver = DriverLog()
    registered = device.RegisteredHostMemory(driver.register, driver.unregister)
    monkeypatch.setattr(device, "_registered", registered)
    runtime = device.CudaRuntime(torch.device("cuda"))  # its host side only: nothing here touches a GPU
    table = runtime.empty_pinned((5 * 2**20 // 16 + 1, 4))  # 5 MiB + 16 B: the caching host allocator locks 8 MiB
    assert list(driver.locked.values()) == [5 * 2**20 + mmap.PAGESIZE] == [registered.current]
    table.fill_(1.5)
    view = table[-3:]
    del table
    gc.collect()
    assert registered.current == 5 * 2**20 + mmap.PAGESIZE  # a view still reads the pages: they stay locked
    assert float(view.sum()) == 1.5 * 12
    del view
    gc.collect()
    assert driver.locked == {} and registered.current == 0 and registered.peak == 5 * 2**20 + mmap.PAGESIZE
    assert driver.seen_at_unregister == [torch.tensor([1.5]).numpy().tobytes()]
    # A host table built for a CUDA run: one locked range per tensor, each its own size.
    specs = [TableSpec("a", 5000, 16), TableSpec("b", 3000, 16)]
    place = OmegaConf.merge(OmegaConf.structured(PlacementConfig), {"kind": "host"})
    prec = OmegaConf.structured(PrecisionConfig)
    group = make_group("host", "fp32", specs, place, prec, RowOptimizer("adagrad"), torch.device("cpu"), 0,
                       runtime=runtime)
    sizes = sorted(t.numel() * t.element_size() for t in (group.store.rows.weights, group.store.state))
    assert sorted(driver.locked.values()) == [-(-n // mmap.PAGESIZE) * mmap.PAGESIZE for n in sizes]
    del group
    gc.collect()
    assert driver.locked == {}


def test_union_plans_are_pinned_again_after_widening(monkeypatch):
    """A distributed rank widens each plan to the union of the ranks' rows
    after the loader pinned it: the new tensors must be pinned too, or their
    copies to the device are synchronous (and counted as pageable)."""
    import recsys_cli.train.union_plan as union_plan

    batches, _ = _planned_batches()
    other_rank = lambda parts, group: [list(parts), [p + 1 for p in parts]]  # noqa: E731  its rows: ours + 1
    monkeypatch.setattr(union_plan, "all_gather_split", other_rank)
    for pin in (None, "runtime"):
        runtime = RecordingRuntime()
        batch = pinning(runtime)(batches[0])
        before = batch.plans[0].unique.numel()
        widened = union_plan.union_plan(batch, None, None if pin is None else runtime.pin)
        assert widened.plans[0].unique.numel() > before  # the union is wider
        pinned = [runtime.is_pinned(t) for t in _host_tensors(widened)]
        assert all(pinned) if pin else not all(pinned)
        copier = BatchCopier(torch.device("meta"), runtime)
        copier.to_device(widened)
        assert (runtime.copies["host_to_device_pageable"] == 0) == bool(pin)
