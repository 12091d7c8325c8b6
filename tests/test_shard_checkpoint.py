"""Checkpoints of sharded tables (recsys_cli/checkpoints/shard_write.py, reshard.py, issue 29 item 4).

Real RowStores (fp32 and int8, Adagrad state width 1) with a cache's dirty
rows as a patch, saved row-wise and table-wise by 2 gloo processes (one
spawn for the whole module) and by one process; then read back over 1-, 2-
and 4-way row ranges, whole, through load_checkpoint, damaged, and pruned.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recsys_cli.checksum import DamagedFile
from recsys_cli.embeddings.quant import patched_entry
from recsys_cli.embeddings.sharding import row_ranges
from recsys_cli.embeddings.store import RowStore
from recsys_cli.embeddings.table_init import TableSpec, build_initial_rows
from recsys_cli.errors import UserError
from recsys_cli import checkpoints as ckpt
from recsys_cli import checkpoints as sc
from recsys_cli.checkpoints import shard_write
from recsys_cli.checkpoints.record import read_record
from recsys_cli.checkpoints.verify import checkpoint_problems

DIM = 4
# (precision, tables): each store fuses its tables, as a TableGroup does
STORES = {"fp32": [TableSpec("a", 10, DIM), TableSpec("b", 7, DIM), TableSpec("c", 1, DIM)],
          "int8": [TableSpec("d", 9, DIM), TableSpec("e", 5, DIM)]}
DIRTY = {"a": [1, 4, 5, 8], "d": [0, 3, 7, 8]}  # rows a cache holds dirty (sorted local ids)
ROW_WISE, OWNER = ("a", "b", "c"), {"d": 1, "e": 0}  # row-wise over both ranks; table-wise on one
STEP = 10


def build() -> dict[str, tuple[RowStore, TableSpec, int]]:
    """table -> (its store, spec, first fused row); the same bits in every process."""
    out = {}
    for n, (precision, specs) in enumerate(STORES.items()):
        rows = sum(s.num_rows for s in specs)
        state = torch.rand(rows, 1, generator=torch.Generator().manual_seed(n))
        store = RowStore(rows, DIM, state, precision=precision, seed=3,
                         table_rows=[(i, s.num_rows) for i, s in enumerate(specs)])
        build_initial_rows(specs, 3, store.write_initial, into=store.initial_view)
        first = 0
        for s in specs:
            out[s.name] = (store, s, first)
            first += s.num_rows
    return out


def snapshot(tables, name: str, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of table `name` as a checkpoint snapshots them, with the
    dirty rows in the range as a patch (ids relative to lo)."""
    store, spec, first = tables[name]
    every = torch.tensor(DIRTY.get(name, []), dtype=torch.int64)
    g = torch.Generator().manual_seed(100 + first)  # the cache's rows: the same whatever range is saved
    values, state = torch.randn(len(every), DIM, generator=g), torch.rand(len(every), 1, generator=g)
    inside = (every >= lo) & (every < hi)

    def patch():
        if not bool(inside.any()):
            return None
        dirty = every[inside]
        return dirty - lo, store.encode(dirty + first, values[inside], step=STEP), state[inside]

    return store.table_snapshot(spec, first + lo, first + hi, patch=patch)


def pieces_of(rank: int, world: int, tables) -> dict:
    out = {}
    for name, (_, spec, _) in tables.items():
        if name in ROW_WISE:
            lo, hi = row_ranges(spec.num_rows, world)[rank]
            out[name] = (lo, hi, snapshot(tables, name, lo, hi))
        elif OWNER[name] % world == rank:
            out[name] = (0, spec.num_rows, snapshot(tables, name, 0, spec.num_rows))
    return out


def caches_of(rank: int) -> list:
    return [{"kind": "lookahead", "tables": [("a", 10)], "clock": 7 + rank, "row_of_slot": torch.arange(5) + rank,
             "history": [torch.tensor([rank, 2])]}, None]


def _save_worker(rank: int, port: int, checkpoint_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        tables = build()
        sc.save_shards(sc.shard_dir(checkpoint_dir, STEP), pieces_of(rank, 2, tables), caches_of(rank), rank, 2)
        # a save that fails on rank 1 (caches it cannot pickle) fails on both, leaving nothing
        try:
            sc.save_shards(sc.shard_dir(checkpoint_dir, 20), pieces_of(rank, 2, tables),
                           [lambda: None] if rank == 1 else caches_of(rank), rank, 2)
            failed = "no error"
        except Exception as e:
            failed = f"{type(e).__name__}: {e}"
        (Path(checkpoint_dir) / f"failed-{rank}.txt").write_text(failed)
        # both ranks past their last collective before either closes its gloo pairs: a rank that
        # tore the group down while the other was still in the failure's agreement aborted it once
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected_cut(entry: dict, lo: int, hi: int) -> dict:
    """The reference: rows [lo, hi) sliced from a whole-table entry, its patch filtered and rebased."""
    out = {k: (v[lo:hi] if isinstance(v, torch.Tensor) else v) for k, v in entry.items() if k != "patch"}
    patch = entry.get("patch")
    if patch is not None:
        keep = (patch["rows"] >= lo) & (patch["rows"] < hi)
        if bool(keep.any()):
            out["patch"] = {k: (v - lo if k == "rows" else v)[keep] for k, v in patch.items()}
    return out


def assert_entries_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want), (set(got), set(want))
    for k, v in want.items():
        if k == "patch":
            assert set(got[k]) == set(v)
            for f in v:
                assert torch.equal(got[k][f], v[f]), (k, f)
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


@pytest.fixture(scope="module")
def whole():
    tables = build()
    return {name: snapshot(tables, name, 0, spec.num_rows) for name, (_, spec, _) in tables.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, whole):
    """A checkpoint directory with step 10's shards saved by 2 gloo processes and its .pt beside."""
    directory = tmp_path_factory.mktemp("sharded")
    mp.spawn(_save_worker, args=(_free_port(), str(directory)), nprocs=2, join=True)
    plan = {"kind": "row", "world_size": 2}
    reference = sc.tables_reference(sc.shard_dir(directory, STEP), plan)
    ckpt.save_checkpoint(directory, STEP, {"step": STEP, "tables": reference})
    return directory


@pytest.fixture(scope="module")
def saved_alone(tmp_path_factory):
    """The same tables' shards saved by one process (no process group): the 1 -> N re-shard."""
    directory = tmp_path_factory.mktemp("alone")
    sc.save_shards(sc.shard_dir(directory, STEP), pieces_of(0, 1, build()), caches_of(0), 0, 1)
    return sc.shard_dir(directory, STEP)


@pytest.mark.parametrize("ways", [1, 2, 4, 3])
@pytest.mark.parametrize("source", ["two ranks", "one process"])
def test_any_row_range_equals_the_unsharded_rows(saved, saved_alone, whole, ways, source):
    directory = sc.shard_dir(saved, STEP) if source == "two ranks" else saved_alone
    for name, entry in whole.items():
        rows = entry["state"].shape[0]
        for lo, hi in row_ranges(rows, ways):
            got = sc.load_shard(directory, name, lo, hi)
            want = expected_cut(entry, lo, hi)
            assert_entries_equal(got, want)
            # and as a reader uses it: the patch put in gives the patched table's rows
            assert_entries_equal(patched_entry(got), expected_cut(patched_entry(entry), lo, hi))
    # a range across the saving ranks' boundary, and inside one piece
    assert_entries_equal(sc.load_shard(directory, "a", 3, 9), expected_cut(whole["a"], 3, 9))
    assert_entries_equal(sc.load_shard(directory, "d", 2, 4), expected_cut(whole["d"], 2, 4))


def test_a_save_failing_on_one_rank_fails_on_every_rank_and_leaves_nothing(saved):
    assert "pickle" in (saved / "failed-1.txt").read_text()
    assert (saved / "failed-0.txt").read_text().startswith(
        "UserError: the checkpoint's shards were not saved: rank 1 failed")
    assert not sc.shard_dir(saved, 20).exists() and not list(saved.glob(".step-*"))


def test_the_shards_are_written_by_each_rank_under_keys_naming_table_and_rows(saved):
    directory = sc.shard_dir(saved, STEP)
    names = {p.name for p in directory.iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "caches-0.pt", "caches-1.pt", sc.MANIFEST} <= names
    assert not list(saved.glob(".*.tmp"))  # renamed into place
    reader = sc.ShardReader(directory)
    keys = set(reader.metadata().state_dict_metadata)
    assert {"a/rows-0-5/weights", "a/rows-5-10/weights", "a/rows-5-10/patch/rows", "d/rows-0-9/codes",
            "d/rows-0-9/scale_bias", "e/rows-0-5/state", "c/rows-0-1/weights"} <= keys
    assert not any(k.startswith("c/rows-1-1") for k in keys)  # rank 1's empty range of the 1-row table
    owner = {(p.table, p.lo): p.rank for p in reader.pieces}
    assert owner[("a", 0)] == 0 and owner[("a", 5)] == 1 and owner[("d", 0)] == 1 and owner[("e", 0)] == 0
    assert reader.tables() == {"a": 10, "b": 7, "c": 1, "d": 9, "e": 5}


def test_assemble_tables_gives_the_patched_whole_tables(saved, whole):
    directory = sc.shard_dir(saved, STEP)
    tables = sc.assemble_tables(directory)
    assert set(tables) == set(whole)
    for name, entry in whole.items():
        assert_entries_equal(tables[name], patched_entry(entry))
    kept = sc.assemble_tables(directory, keep_patches=True)
    for name, entry in whole.items():
        assert_entries_equal(kept[name], entry)


def test_load_checkpoint_reads_a_sharded_checkpoint_as_whole_tables(saved, whole):
    path = saved / ckpt.step_file(STEP)
    assert sc.shard_dir(saved, STEP) == sc.shard_dir_of(path)
    record = read_record(path)
    name = sc.shard_dir(saved, STEP).name
    assert f"{name}/__1_0.distcp" in record and f"{name}/{sc.MANIFEST}" in record
    assert checkpoint_problems(path) == []  # `recsys verify` checks the shards too
    state = ckpt.load_checkpoint(path)
    for name, entry in whole.items():
        assert_entries_equal(state["tables"][name], patched_entry(entry))
    state = ckpt.load_checkpoint(path, keep_patches=True)
    for name, entry in whole.items():
        assert_entries_equal(state["tables"][name], entry)
    ref = ckpt.load_checkpoint(path, keep_patches=True, whole_tables=False)["tables"]
    assert ref["plan"] == {"kind": "row", "world_size": 2} and Path(ref["directory"]) == sc.shard_dir(saved, STEP)


def test_caches_come_back_for_the_same_world_size_only(saved):
    directory = sc.shard_dir(saved, STEP)
    for rank in (0, 1):
        got = sc.load_rank_caches(directory, rank, 2)
        want = caches_of(rank)
        assert got[1] is None and got[0]["clock"] == want[0]["clock"] and got[0]["tables"] == want[0]["tables"]
        assert torch.equal(got[0]["row_of_slot"], want[0]["row_of_slot"])
        assert torch.equal(got[0]["history"][0], want[0]["history"][0])
    assert sc.load_rank_caches(directory, 0, 1) is None
    assert sc.load_rank_caches(directory, 3, 4) is None


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_shard_file_is_one_error_naming_it(saved, tmp_path, whole):
    copy = tmp_path / "checkpoints"
    shutil.copytree(saved, copy)
    directory = sc.shard_dir(copy, STEP)
    damaged = directory / "__1_0.distcp"
    _flip(damaged, damaged.stat().st_size // 2)
    with pytest.raises(UserError, match="__1_0.distcp is damaged: its xxh3_64 is") as e:
        ckpt.load_checkpoint(copy / ckpt.step_file(STEP))
    assert isinstance(e.value, DamagedFile) and "\n" not in str(e.value)
    with pytest.raises(DamagedFile, match="__1_0.distcp"):
        sc.load_shard(directory, "d", 0, 9)  # on rank 1
    assert_entries_equal(sc.load_shard(directory, "e", 0, 5), whole["e"])  # rank 0's file alone is read
    assert any("__1_0.distcp is damaged" in p for p in checkpoint_problems(copy / ckpt.step_file(STEP)))
    # the manifest itself
    _flip(directory / sc.MANIFEST, 20)
    with pytest.raises(DamagedFile, match=sc.MANIFEST):
        ckpt.load_checkpoint(copy / ckpt.step_file(STEP))
    with pytest.raises(DamagedFile, match=sc.MANIFEST):
        sc.load_shard(directory, "e", 0, 5)


def test_keep_last_removes_shard_directories_with_their_checkpoints(tmp_path, whole):
    tables = build()
    for step in (1, 2, 3):
        directory = sc.shard_dir(tmp_path, step)
        sc.save_shards(directory, pieces_of(0, 1, tables), None, 0, 1)
        ckpt.save_checkpoint(tmp_path, step, {"step": step, "tables": sc.tables_reference(directory, {})}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-00000002.files.json", "step-00000002.pt", "step-00000002.shards",
        "step-00000003.files.json", "step-00000003.pt", "step-00000003.shards"]
    # a save killed before its .pt (an orphan directory) or mid-write (a temporary one) is removed too
    sc.save_shards(sc.shard_dir(tmp_path, 4), pieces_of(0, 1, tables), None, 0, 1)
    (tmp_path / ".step-00000005.shards.tmp").mkdir()
    ckpt.prune(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-00000002.shards", "step-00000003.shards"]
    # the same step saved again replaces its directory whole
    sc.save_shards(sc.shard_dir(tmp_path, 3), pieces_of(0, 1, tables), None, 0, 1)
    ckpt.save_checkpoint(tmp_path, 3, {"step": 3, "tables": sc.tables_reference(sc.shard_dir(tmp_path, 3), {})}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-00000002.shards", "step-00000003.shards"]
    assert checkpoint_problems(tmp_path / ckpt.step_file(3)) == []
    for name, entry in whole.items():
        assert_entries_equal(ckpt.load_checkpoint(tmp_path / ckpt.step_file(3))["tables"][name], patched_entry(entry))


def test_a_row_range_of_a_large_store_is_written_without_the_rest_of_it(tmp_path):
    """A piece is a view of its store: only its own rows reach the file (no
    whole-storage write, no clone of the shard)."""
    store = RowStore(20000, 16, torch.zeros(20000, 1))
    build_initial_rows([TableSpec("big", 20000, 16)], 0, store.write_initial, into=store.initial_view)
    piece = store.table_snapshot(TableSpec("big", 20000, 16), 100, 150)
    assert piece["weights"].untyped_storage().nbytes() == 20000 * 16 * 4
    assert shard_write._exact(piece["weights"]).data_ptr() == piece["weights"].data_ptr()
    directory = sc.save_shards(tmp_path / "s", {"big": (100, 150, piece)}, None, 0, 1)
    assert (directory / "__0_0.distcp").stat().st_size < 50 * 17 * 4 + 8192
    assert torch.equal(sc.load_shard(directory, "big", 100, 150)["weights"], piece["weights"])
    with pytest.raises(UserError, match=r"rows \[0, 100\) of table 'big' are in no shard"):
        sc.load_shard(directory, "big", 0, 120)


def test_a_disk_shard_is_written_chunk_by_chunk_and_reads_back_as_its_disk_checkpoint(tmp_path, monkeypatch):
    """A shard on disk (DiskRowStore; here rows [20, 32) of a 40-row int8
    table, Adagrad state) goes in chunks of records read as DCP writes
    them, its cache's dirty rows put in: it reads back equal to the disk
    tier's own checkpoint of it (materialize), over ranges across chunks."""
    from recsys_cli.embeddings.disk_checkpoint import materialize
    from recsys_cli.embeddings.disk_store import DiskRowStore

    spec = TableSpec("f", 12, DIM, first_row=20, table_num_rows=40)
    store = DiskRowStore([spec], [0], "int8", "stochastic", 3, 1, 0.0, str(tmp_path / "live"), host_cache_rows=4)
    ids = torch.tensor([0, 3, 4, 11])
    store.write(ids, torch.randn(4, DIM, generator=torch.Generator().manual_seed(1)), torch.rand(4, 1), step=2)
    dirty = torch.tensor([4, 9])
    dirty_rows = torch.randn(2, DIM, generator=torch.Generator().manual_seed(2))

    def patch():
        return dirty, store.encode(dirty, dirty_rows, step=STEP), torch.full((2, 1), 0.5)

    monkeypatch.setattr(shard_write, "CHUNK_BYTES", 5 * store.record_bytes)  # 12 rows: chunks of 5, 5 and 2
    directory = sc.save_shards(tmp_path / "s", {"f": (20, 32, store.table_snapshot(spec, 0, 12, patch=patch))},
                               None, 0, 1)
    assert [(p.lo, p.hi) for p in sc.ShardReader(directory).pieces_of("f")] == [(20, 25), (25, 30), (30, 32)]
    manifest = store.table_snapshot(spec, 0, 12, patch=patch).save_files(tmp_path / "ck", STEP)
    want = materialize({**manifest, "directory": str(tmp_path / "ck")})
    store.close()
    assert_entries_equal(sc.load_shard(directory, "f", 20, 32), want)
    for lo, hi in [(20, 25), (23, 31), (29, 30), (30, 30)]:
        assert_entries_equal(sc.load_shard(directory, "f", lo, hi), expected_cut(want, lo - 20, hi - 20))


@pytest.mark.parametrize("where", ["shards", "caches"])
def test_a_full_disk_in_a_shard_save_is_one_line_with_the_space_needed(tmp_path, monkeypatch, where):
    """Issue 40 problem 5: inside DCP's write (and torch.save's) a full disk
    comes out as torch's RuntimeError "unexpected pos", the OSError lost on
    the way between ranks: the error must still say the disk is full, the
    space a checkpoint needs and the one kept, and leave no temporary files."""
    import errno

    tables = build()
    sc.save_shards(sc.shard_dir(tmp_path, STEP), pieces_of(0, 1, tables), caches_of(0), 0, 1)
    (tmp_path / ckpt.step_file(STEP)).write_bytes(b"\0" * 1000)  # the earlier checkpoint's .pt
    real_write = shard_write._HashingStream.write if where == "shards" else shard_write.HashingWriter.write
    sent = [0]

    def fills_up(self, data):  # a few bytes pass, then the disk is full
        sent[0] += 1
        if sent[0] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    monkeypatch.setattr(shard_write._HashingStream if where == "shards" else shard_write.HashingWriter, "write", fills_up)
    with pytest.raises(UserError) as failed:
        sc.save_shards(sc.shard_dir(tmp_path, 20), pieces_of(0, 1, tables), caches_of(0), 0, 1,
                       space_note=ckpt.space_note)  # as the sharded strategy passes it
    message = str(failed.value)
    assert "no space left on device; a checkpoint needs about " in message, message
    assert f"the last good checkpoint, {tmp_path / ckpt.step_file(STEP)}, is kept" in message, message
    assert "\n" not in message
    assert not sc.shard_dir(tmp_path, 20).exists() and not list(tmp_path.glob(".step-*"))
