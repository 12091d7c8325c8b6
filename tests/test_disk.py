"""The disk tier: tables in a file behind a bounded host cache behind the lookahead cache.

Exactness is tested against `device` (fp32) and against the same cache over
a host store (low precision): the disk store keeps the same bits, so it must
train to the same bits."""

import os

import pytest
import torch

from embedding_harness import build, make_batches, run, train
from test_placement_exact import SMALL_CACHE, assert_equal

pytestmark = pytest.mark.exact  # bit-for-bit claims: under deterministic algorithms (tests/conftest.py)

BATCHES = make_batches(40, batch_size=16)
TINY_HOST_CACHE = 8  # a batch writes back more rows than this: the host cache evicts every step


@pytest.fixture(scope="module", params=["sgd", "adagrad"])
def reference(request):
    return request.param, run(BATCHES, {"kind": "device"}, optimizer=request.param)


@pytest.mark.parametrize("placement", [
    {"kind": "disk", "cache_rows": SMALL_CACHE, "window": 1, "host_cache_rows": TINY_HOST_CACHE},
    {"kind": "disk", "cache_rows": SMALL_CACHE, "window": 4, "host_cache_rows": TINY_HOST_CACHE},
    {"kind": "disk", "cache_rows": SMALL_CACHE, "window": 4, "host_cache_rows": 0},
    {"kind": "disk", "cache_rows": 400, "window": 8, "host_cache_ratio": 0.05},
    {"kind": "lookahead", "cache_rows": SMALL_CACHE, "window": 2, "overrides": {"b": "disk", "h": "device"},
     "host_cache_rows": TINY_HOST_CACHE},
], ids=["w1", "w4", "no-host-cache", "w8-big", "per-table"])
def test_disk_matches_device_bit_for_bit(reference, placement, tmp_path):
    optimizer, ref = reference
    model, opt = build({**placement, "disk_path": str(tmp_path)}, optimizer=optimizer)
    result = train(BATCHES, model, opt)
    from embedding_harness import dense_state, tables_fp32

    assert_equal((result.losses, tables_fp32(model.embeddings), dense_state(model)), ref)
    stats = model.embeddings.stats()
    assert stats["disk_bytes_read"] > 0  # the disk really served rows
    if placement["kind"] == "disk" and placement.get("host_cache_rows") in (0, TINY_HOST_CACHE):  # rows go back to the file
        assert stats["disk_bytes_written"] > 0 and stats["host_cache_misses"] > len(BATCHES)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_low_precision_on_disk_equals_host(precision, tmp_path):
    """int8/int4 rows on disk behind the fp32 lookahead cache train to the
    bits of the same tables in host memory behind the same cache."""
    cache = {"cache_rows": SMALL_CACHE, "window": 4}
    host = run(BATCHES, {"kind": "lookahead", **cache}, {"kind": precision}, optimizer="adagrad")
    disk = run(BATCHES, {"kind": "disk", **cache, "host_cache_rows": TINY_HOST_CACHE, "disk_path": str(tmp_path)},
               {"kind": precision}, optimizer="adagrad")
    assert_equal(disk, host)


def test_the_trainer_never_waits_on_the_prefetchers_disk_io(tmp_path):
    """While the prefetch thread's prepare() is blocked inside a disk read,
    the trainer releases and completes batches: the cache's lock is not held
    across the store's I/O. Evaluation's read() meanwhile waits for the fill
    instead of seeing rows that are neither in a slot nor current in the store."""
    import threading

    from recsys_cli.embeddings.cache import CachedGroup

    # room for both batches: the second one's prepare does not wait for the first to complete
    model, _ = build({"kind": "disk", "cache_rows": 400, "window": 2, "host_cache_rows": TINY_HOST_CACHE,
                      "disk_path": str(tmp_path)})
    (group,) = [g for g in model.embeddings.groups if isinstance(g, CachedGroup)]
    at = model.embeddings.groups.index(group)
    first, second = (model.embeddings.plan_batch(b).plans[at] for b in BATCHES[:2])
    group.prepare(first)
    in_read, go_on, read_gave_up = threading.Event(), threading.Event(), threading.Event()
    real_read = group.store.read

    def blocked_read(ids):  # the disk read of the second batch's misses, held until the test says so
        in_read.set()
        if not go_on.wait(120):  # a lock held across this read keeps the trainer from ever saying so
            read_gave_up.set()
        return real_read(ids)

    group.store.read = blocked_read
    failed = []

    def prefetcher():
        try:
            group.prepare(second)
        except BaseException as e:  # noqa: BLE001 (reported below)
            failed.append(e)
            in_read.set()

    prefetch = threading.Thread(target=prefetcher)
    prefetch.start()
    in_read.wait()
    assert not failed, failed
    group.release(first)  # the trainer's thread, while the disk read is in progress
    assert group.completed == 1 and not read_gave_up.is_set(), "release() waited on the prefetcher's disk read"
    evaluated = []

    def evaluate():
        rows = group.read(second.unique)
        evaluated.append((go_on.is_set(), rows))

    reader = threading.Thread(target=evaluate)
    reader.start()
    reader.join(1)  # time to get to the lock
    go_on.set()
    prefetch.join()
    reader.join()
    assert not read_gave_up.is_set()
    (after_the_fill, rows), = evaluated
    assert after_the_fill, "read() went ahead while rows were moving between the store and the cache"
    group.check_ownership()
    assert bool((group.slot_index.lookup(second.unique) >= 0).all())
    assert torch.equal(rows, group.read(second.unique))


def test_evaluation_reads_only_the_rows_the_cache_does_not_hold(tmp_path):
    """read() (evaluation, predict) serves resident rows from the cache, their
    owner, and goes to the disk for the others only: the same logits as on
    `device`, and no disk traffic for rows the cache holds."""
    from embedding_harness import tables_fp32

    from recsys_cli.embeddings.cache import CachedGroup

    held_out = make_batches(4, batch_size=16, seed=1)
    device, device_opt = build({"kind": "device"})
    train(BATCHES, device, device_opt)
    model, opt = build({"kind": "disk", "cache_rows": 400, "window": 4, "host_cache_rows": TINY_HOST_CACHE,
                        "disk_path": str(tmp_path)})
    train(BATCHES, model, opt)
    (group,) = [g for g in model.embeddings.groups if isinstance(g, CachedGroup)]
    store = group.store
    before = store.stats()
    with torch.no_grad():
        for batch in held_out:
            assert torch.equal(model(batch), device(batch))
    evaluated = store.stats()
    resident = group.row_of_slot[group.row_of_slot >= 0]
    assert bool(group.dirty.any())  # some rows' store copies are stale: the cache's values are the current ones
    ids = torch.cat([resident, torch.arange(group.num_rows)])
    looked_up = lambda s: s["host_cache_hits"] + s["host_cache_misses"]  # noqa: E731
    for rows, store_reads in ((resident, 0), (ids, group.num_rows - resident.numel())):
        start = store.stats()
        got = group.read(rows)
        end = store.stats()
        assert looked_up(end) - looked_up(start) == store_reads  # every row the cache holds came from the cache
        if store_reads == 0:
            assert end["disk_bytes_read"] == start["disk_bytes_read"]
    assert torch.equal(got[resident.numel():], torch.cat(list(tables_fp32(device.embeddings).values())))
    print(f"\nevaluation of {len(held_out)} batches read {evaluated['disk_bytes_read'] - before['disk_bytes_read']:,} "
          f"disk bytes; {resident.numel()} of {group.num_rows} rows resident")


def test_parallel_disk_reads_train_to_the_same_bits(reference, tmp_path, monkeypatch):
    """With several I/O threads issuing a read's runs at once (here every read
    of two runs or more goes to the threads), disk still equals device bit for bit."""
    import recsys_cli.embeddings.disk_store as disk_store
    from recsys_cli.embeddings.cache import CachedGroup
    from embedding_harness import dense_state, tables_fp32

    monkeypatch.setattr(disk_store, "PARALLEL_RUNS", 1)
    monkeypatch.setattr(disk_store, "PROBE_RUNS", 0)
    monkeypatch.setattr(disk_store, "SLOW_READ_SECONDS", 0.0)  # page-cache reads count as slow
    optimizer, ref = reference
    model, opt = build({"kind": "disk", "cache_rows": SMALL_CACHE, "window": 4, "host_cache_rows": TINY_HOST_CACHE,
                        "disk_io_threads": 4, "disk_path": str(tmp_path)}, optimizer=optimizer)
    result = train(BATCHES, model, opt)
    assert_equal((result.losses, tables_fp32(model.embeddings), dense_state(model)), ref)
    (group,) = [g for g in model.embeddings.groups if isinstance(g, CachedGroup)]
    assert group.store._io_pool is not None  # the threads did read


def _store(tmp_path, io_threads: int, rows: int = 500_000):
    from recsys_cli.embeddings.disk_store import DiskRowStore
    from recsys_cli.embeddings.table_init import TableSpec

    return DiskRowStore([TableSpec("t", rows, 8)], [0], "fp32", "stochastic", 0, 1, 0.0, str(tmp_path),
                        host_cache_rows=0, io_threads=io_threads)


def test_parallel_reads_return_the_serial_reads_bytes(tmp_path, monkeypatch):
    """Thousands of scattered runs (rows more than a page apart), read by one
    thread and by eight: the same records, and a read past the file's end is
    an error from either."""
    import recsys_cli.embeddings.disk_store as disk_store

    monkeypatch.setattr(disk_store, "SLOW_READ_SECONDS", 0.0)  # page-cache reads count as slow
    serial, parallel = _store(tmp_path, 1), _store(tmp_path, 8)
    ids = torch.randperm(2_500, generator=torch.Generator().manual_seed(0)) * 200
    ids = torch.cat([ids, ids[:100]])  # repeats come back for every position
    rows = torch.randn(2_500, 8, generator=torch.Generator().manual_seed(1))
    for store in (serial, parallel):
        store.write(ids[:2_500], rows, torch.full((2_500, 1), 2.0))
    # through the store's protocol (protocols.RowStoreProtocol): rows and optimizer state
    got_serial, got_parallel = serial.read(ids), parallel.read(ids)
    assert parallel._io_pool is not None and serial._io_pool is None  # which threads read: the store's own
    assert parallel.stats()["disk_reads"] == serial.stats()["disk_reads"] == 2_500
    monkeypatch.setattr(disk_store, "SLOW_READ_SECONDS", 10.0)
    fast = _store(tmp_path, 8)
    fast.read(ids)
    assert fast._io_pool is None  # reads faster than the threshold stay on the calling thread
    fast.close()
    assert torch.equal(got_parallel[0], got_serial[0]) and torch.equal(got_parallel[1], got_serial[1])
    assert torch.equal(got_parallel[0], rows[torch.cat([torch.arange(2_500), torch.arange(100)])])
    assert bool((got_parallel[1] == 2.0).all())
    from recsys_cli.errors import UserError

    for store in (serial, parallel):  # the file loses its last rows under the store
        os.ftruncate(store.fd, 400_000 * store.record_bytes)
        monkeypatch.setattr(store, "_check_file", lambda: None)  # past the size check: each read checks its length
        with pytest.raises(UserError, match=f"^{store.path}: short read .* the live disk table was truncated"):
            store.read(torch.arange(0, 500_000, 300))
        store.close()
    assert parallel._io_pool is None


def test_a_live_file_truncated_or_replaced_behind_the_store_is_named(tmp_path):
    """Reads that the truncated file still holds, and writes (which would
    silently extend it), stop once the file is shorter than the table, or
    is another file (issue 27)."""
    import os

    from recsys_cli.errors import UserError

    store = _store(tmp_path, 1, rows=1000)
    rows, state = store.read(torch.arange(4))
    os.truncate(store.path, store.record_bytes * 500)
    for touch in (lambda: store.read(torch.arange(4)), lambda: store.write(torch.arange(4), rows, state)):
        with pytest.raises(UserError, match=f"^{store.path}: the live disk table was truncated to "
                                            f"{store.record_bytes * 500:,} of {store.record_bytes * 1000:,} bytes"):
            touch()
    store.close()
    store = _store(tmp_path, 1, rows=1000)
    other = tmp_path / "other.bin"
    other.write_bytes(b"\0" * store.record_bytes * 1000)
    os.replace(other, store.path)
    with pytest.raises(UserError, match="the live disk table was replaced behind the run"):
        store.read(torch.arange(4))
    store.close()


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_a_disk_table_built_on_every_core_has_the_serial_builds_bytes(tmp_path, precision):
    """The file is built by table_init.build_initial_rows (chunks on every
    core at once); its bytes equal the serial build it replaced, computed here
    as that did: each table's rows from init_rows in order, encoded with the
    INIT_STEP keys, packed with their state."""
    import numpy as np

    from recsys_cli.embeddings.disk_store import DiskRowStore
    from recsys_cli.embeddings.quant import INIT_STEP
    from recsys_cli.embeddings.table_init import TableSpec, init_rows

    specs = [TableSpec("C1", 3001, 16), TableSpec("C9", 1200, 16, first_row=700, table_num_rows=5000)]
    store = DiskRowStore(specs, [0, 8], precision, "stochastic", 11, 1, 0.25, str(tmp_path), host_cache_rows=0)
    try:
        expected, start = [], 0
        for spec in specs:
            ids = torch.arange(start, start + spec.num_rows)
            encoded = store.rows.encode(init_rows(spec, 0, spec.num_rows, 11), store.key(ids, INIT_STEP))
            expected.append(store.codec.pack(encoded, torch.full((spec.num_rows, 1), 0.25)))
            start += spec.num_rows
        got = torch.from_numpy(np.fromfile(store.path, dtype=np.uint8))
        assert torch.equal(got[: start * store.record_bytes].view(start, -1), torch.cat(expected))
    finally:
        store.close()
