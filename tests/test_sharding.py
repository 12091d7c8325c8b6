"""Sharded tables (placement.sharding): each row has one owner, ids routed to it by all-to-all.

One launch of 2 gloo processes trains every sharded configuration in turn
(the process start-up is paid once, as in test_distributed.py); the
references are one process on the same global batch. The dense all-reduce
averages gradients in another order than one process sums them, so whole
runs agree to a tolerance (1e-5, as grad sync's); what involves no reordered
sum is tested bit for bit: pooled rows, the owner's row update from given
pooled gradients, and a run against itself.
"""

from __future__ import annotations

import pytest
import torch
import train_config
from omegaconf import OmegaConf

from bench.gpu_check import SHARDED_CHECK_TABLES, sharded_exchange_checks
from recsys_cli.config import TrainConfig
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.sharded import ShardedEmbeddingBagCollection, build_sharded_embeddings
from recsys_cli.errors import UserError
from recsys_cli import checkpoints as ckpt
from recsys_cli.train import distributed
from recsys_cli.train.memory import peak_rss_bytes
from recsys_cli.train.trainer import Trainer
from recsys_cli.train.training_data import resolve_dataset

pytestmark = pytest.mark.exact

NPROC = 2
STEPS = 20
LOOKAHEAD = dict(placement__kind="lookahead", placement__cache_rows=3000, placement__window=4)
# Caches that hold every row of every table: a low-precision table then rounds
# only where one process's would (the rows' rounding keys are the whole table's).
INT8 = dict(placement__kind="lookahead", placement__cache_rows=20000, precision__kind="int8")
INT4_HOST = dict(placement__kind="host", precision__kind="int4", precision__cache_ratio=1.0)  # host + int4: an on-demand cache
FP16_CACHE = dict(placement__kind="cache", placement__cache_rows=20000, precision__kind="fp16")
HALF = dict(trainer__max_steps=STEPS // 2)
# Adagrad, with an accumulator floor that bounds how far a gradient's last
# bits can move a weight. The sharded run sums its dense gradients by
# all-reduce, one process by one backward over the global batch: the two sums
# differ in their last bits (delta, a few ulps of the gradient's partial sums,
# how many depends on the CPU's kernels). An Adagrad step
# lr * g / (sqrt(G) + eps) changes by at most lr * delta / eps, so T steps move
# a weight by at most T * lr * delta / eps. With eps = 1e-8, a weight whose
# gradients cancel (G near 0) turns last-bit noise into steps of up to lr:
# 7.4e-5 on one AMD EPYC, 3.1e-5 on another, against a bound of 1e-4. With
# eps = 0.1 the bound is 20 * 0.1 * delta / 0.1 = 20 * delta: twenty ulps of the
# gradients, on any machine, under the 1e-5 of the largest weight the test
# allows. Every step is still at most lr (sqrt(G) >= |g|), and the rows keep
# their row-wise accumulators. A real fault (a gradient left out of the
# all-reduce, a row updated twice) moves weights by whole steps.
ADAGRAD = dict(optimizer__name="adagrad", optimizer__eps=0.1)
# Tables of ~320 MiB (fp32, dim 16), so that they dominate a process's peak RSS.
BIG = dict(dataset__synthetic__cardinality_scale=0.15, trainer__max_steps=5)
CONFIGS = {
    "big_row": dict(placement__sharding="row", **BIG),  # first: VmHWM is the process's peak so far
    "table": dict(placement__sharding="table"),
    "row": dict(placement__sharding="row"),
    "table_again": dict(placement__sharding="table"),
    "table_lookahead": dict(placement__sharding="table", **LOOKAHEAD),
    "row_host_adagrad": dict(placement__sharding="row", placement__kind="host", **ADAGRAD),
    "row_disk": dict(placement__sharding="row", placement__kind="disk", placement__cache_rows=3000,
                     placement__host_cache_rows=16),
    "table_cache_dedup": dict(placement__sharding="table", placement__kind="cache", placement__cache_rows=3000,
                              dedup__enabled=True),
    "row_int8": dict(placement__sharding="row", **INT8),
    "row_disk_int8": dict(placement__sharding="row", **{**INT8, "placement__kind": "disk"}, placement__host_cache_rows=16),
    "row_int8_dedup": dict(placement__sharding="row", **INT8, dedup__enabled=True),
    "table_host_int4": dict(placement__sharding="table", **INT4_HOST),
    "auto_cache_fp16_adagrad": dict(placement__sharding="auto", **FP16_CACHE, **ADAGRAD),
}
REFERENCES = {"fp32": {}, "adagrad": ADAGRAD, "int8": INT8,
              "dedup": dict(dedup__enabled=True), "int8_dedup": dict(**INT8, dedup__enabled=True), "int4": INT4_HOST,
              "fp16_adagrad": dict(**FP16_CACHE, **ADAGRAD)}
REFERENCE_OF = {"table": "fp32", "row": "fp32", "table_lookahead": "fp32", "row_host_adagrad": "adagrad",
                "row_disk": "fp32", "table_cache_dedup": "dedup", "row_int8": "int8", "row_disk_int8": "int8",
                "row_int8_dedup": "int8_dedup", "table_host_int4": "int4", "auto_cache_fp16_adagrad": "fp16_adagrad"}


def config(cache_dir, **overrides):
    return train_config.config(cache_dir, **{"trainer__max_steps": STEPS, "trainer__dist_timeout": 60, **overrides})


def tables(trainer: Trainer) -> dict[tuple[str, int], torch.Tensor]:
    """(table, first row) -> fp32 rows (cached copies where resident) of every table or shard this process holds."""
    out = {}
    for g in trainer.embeddings.groups:
        for t in g.tables:
            lo = g.row_offset[t.name]
            out[(t.name, t.first_row)] = g.read(torch.arange(lo, lo + t.num_rows)).clone()
    return out


def result(trainer: Trainer) -> dict:
    return {"losses": list(trainer.step_losses), "tables": tables(trainer), "evals": [e["auc"] for e in trainer.evals],
            "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "report": trainer.strategy.report(), "table_bytes": trainer.embeddings.memory()["table"],
            "peak_rss": peak_rss_bytes(), "duplication": trainer.duplication()}


def run(container: dict, fit: bool = True) -> dict:
    trainer = Trainer(OmegaConf.merge(OmegaConf.structured(TrainConfig), container))
    trainer.record_losses = True
    if not fit:  # what the trainer starts from (a resume's restored rows)
        return {"tables": tables(trainer)}
    trainer.fit()
    return result(trainer)


def train_runs(runs: list[tuple[str, dict]]) -> dict:
    """A worker: every (name, config) in turn; a name starting "built:" is only built, not trained."""
    ctx = distributed.init(timeout_s=60, device="cpu")
    out = {name: run(container, fit=not name.startswith("built:")) for name, container in runs}
    if ctx.enabled:
        out["exchange"] = sharded_exchange_checks(torch.device("cpu"))
    distributed.teardown()
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("recsys-cache")
    resolve_dataset(config(path).dataset)
    resolve_dataset(config(path, **BIG).dataset)
    return path


@pytest.fixture(scope="module")
def checkpoints(cache_dir, tmp_path_factory):
    """Half of the fp32 run: one process's checkpoint (its result beside), and
    where the 2-process row-wise half writes its sharded one."""
    one, two = tmp_path_factory.mktemp("ck-one"), tmp_path_factory.mktemp("ck-two")
    half = run(OmegaConf.to_container(config(cache_dir, **HALF, trainer__checkpoint_dir=str(one))))
    return {"one": one, "two": two, "one_half": half}


def resumed(cache_dir, location, **overrides) -> dict:
    return OmegaConf.to_container(config(cache_dir, **overrides, trainer__resume=str(location),
                                         trainer__checkpoint_dir=str(location), trainer__final_checkpoint=False))


@pytest.fixture(scope="module")
def runs(cache_dir, checkpoints):
    launched = [(n, OmegaConf.to_container(config(cache_dir, **o))) for n, o in CONFIGS.items()]
    launched += [("half", OmegaConf.to_container(config(cache_dir, placement__sharding="row", **HALF,
                                                       trainer__checkpoint_dir=str(checkpoints["two"])))),
                 ("one_to_two", resumed(cache_dir, checkpoints["one"], placement__sharding="table"))]
    return distributed.launch(train_runs, NPROC, launched)


@pytest.fixture(scope="module")
def four(cache_dir, checkpoints, runs):
    """4 processes (more than this machine's cores: trainer.oversubscribe): a
    re-shard of the 2-rank checkpoint, before and after training on, and two
    placements behind 4-way shards."""
    more = dict(trainer__oversubscribe=True)
    launched = [("built:two_to_four", resumed(cache_dir, checkpoints["two"], placement__sharding="auto", **more)),
                ("two_to_four", resumed(cache_dir, checkpoints["two"], placement__sharding="auto", **more)),
                ("row_int8", OmegaConf.to_container(config(cache_dir, placement__sharding="row", **INT8, **more))),
                ("table_host", OmegaConf.to_container(config(cache_dir, placement__sharding="table",
                                                             placement__kind="host", **more)))]
    return distributed.launch(train_runs, 4, launched)


@pytest.fixture(scope="module")
def references(cache_dir):
    return {name: run(OmegaConf.to_container(config(cache_dir, **o))) for name, o in REFERENCES.items()}


def whole_tables(ranks: dict, name: str) -> dict[tuple[str, int], torch.Tensor]:
    out: dict = {}
    for r in ranks.values():
        out.update(r[name]["tables"])
    return out


@pytest.mark.slow  # several processes
@pytest.mark.parametrize("name", list(REFERENCE_OF))
def test_sharded_runs_follow_one_process_on_the_global_batch(runs, references, name):
    """Every placement and precision behind a shard, table- and row-wise, SGD
    and Adagrad, dedup: losses, every shard's rows (against the same rows of
    one process's table), the dense model and the evaluations."""
    got, ref = runs[0][name], references[REFERENCE_OF[name]]
    rel = 1e-5  # SGD, and Adagrad with its accumulator floor (ADAGRAD): last-bit differences stay last-bit
    assert len(got["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rel, atol=0)
    shards = whole_tables(runs, name)
    for table in {t for t, _ in ref["tables"]}:
        pieces = sorted((first, rows) for (t, first), rows in shards.items() if t == table)
        assert [first for first, _ in pieces][0] == 0
        rows = torch.cat([r for _, r in pieces])  # every row exactly once, in order
        whole = ref["tables"][(table, 0)]
        torch.testing.assert_close(rows, whole, rtol=rel, atol=rel * float(whole.abs().max()), msg=table)
    worst = max(float((got["model"][k] - v).abs().max() / v.abs().max().clamp_min(1e-12)) for k, v in ref["model"].items())
    print(f"\n{name}: largest dense difference {worst:.2e} of its tensor's largest weight")
    for k, v in ref["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=rel, atol=rel * float(v.abs().max()), msg=k)
    assert got["evals"] == pytest.approx(ref["evals"], abs=1e-5)


def assert_follows(got: dict, ref: dict, rel: float = 1e-5) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rel, atol=0)
    for k, v in ref["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=rel, atol=rel * float(v.abs().max()), msg=k)


@pytest.mark.slow  # several processes
def test_4_processes_follow_one_process_behind_host_and_int8_lookahead_shards(four, references):
    for name, reference in (("row_int8", "int8"), ("table_host", "fp32")):
        assert_follows(four[0][name], references[reference])
        shards = whole_tables(four, name)
        for table in {t for t, _ in references[reference]["tables"]}:
            rows = torch.cat([r for _, r in sorted((f, r) for (t, f), r in shards.items() if t == table)])
            whole = references[reference]["tables"][(table, 0)]
            torch.testing.assert_close(rows, whole, rtol=1e-5, atol=1e-5 * float(whole.abs().max()), msg=table)


@pytest.mark.slow  # several processes
def test_a_resume_on_another_number_of_processes_reshards_the_saved_rows(checkpoints, runs, four, references,
                                                                         cache_dir):
    """The 2-rank row-wise checkpoint read by 4 auto-sharded ranks: every
    rank's rows equal the saved rows (torch.equal, the checkpoint's own shard
    files assembled), and the run goes on as one process would: 2 -> 4, 2 -> 1
    and 1 -> 2 (a one-process checkpoint cut into table-wise shards)."""
    saved_at = checkpoints["two"] / f"step-{STEPS // 2:08d}.pt"
    saved = ckpt.load_checkpoint(saved_at)["tables"]  # whole tables, patches in
    for rank in four.values():
        for (table, first), rows in rank["built:two_to_four"]["tables"].items():
            assert torch.equal(rows, saved[table]["weights"][first:first + rows.shape[0]]), (table, first)
    whole = references["fp32"]
    first_half = runs[0]["half"]["losses"]
    assert len(first_half) == STEPS // 2
    two_to_one = run(resumed(cache_dir, checkpoints["two"]))
    for got in (four[0]["two_to_four"], two_to_one):
        assert_follows({**got, "losses": first_half + got["losses"]}, whole)
    one_to_two = runs[0]["one_to_two"]
    assert_follows({**one_to_two, "losses": checkpoints["one_half"]["losses"] + one_to_two["losses"]}, whole)


@pytest.mark.slow  # several processes
def test_with_dedup_each_owner_pools_the_global_batchs_distinct_bags_once(runs, references):
    """Bags repeated anywhere in the global batch, across ranks too, are
    looked up once by their owner: the run's duplication statistics (summed
    over the owners) are one process's with dedup on the same batches."""
    for name, reference in (("table_cache_dedup", "dedup"), ("row_int8_dedup", "int8_dedup")):
        got, ref = runs[0][name]["duplication"], references[reference]["duplication"]
        assert ref["lookups_saved_by_dedup"] > 0
        assert got["duplicated_ids_per_feature"] == pytest.approx(ref["duplicated_ids_per_feature"], rel=1e-12)
        for key in ("duplicated_ids", "lookups_saved_by_dedup"):
            assert got[key] == pytest.approx(ref[key], rel=1e-12), (name, key)


@pytest.mark.slow  # several processes
def test_a_sharded_run_is_bit_exact_run_to_run(runs):
    for rank in runs.values():
        a, b = rank["table"], rank["table_again"]
        assert a["losses"] == b["losses"] and a["evals"] == b["evals"]
        for key, rows in a["tables"].items():
            assert torch.equal(rows, b["tables"][key]), key


@pytest.mark.slow  # several processes
def test_each_rank_holds_about_half_the_table_bytes(runs, references):
    """One owner per row: the ranks' table bytes add up to one process's, each near half of it."""
    whole = references["fp32"]["table_bytes"]
    for name in ("table", "row"):
        per_rank = [runs[r][name]["table_bytes"] for r in range(NPROC)]
        assert sum(per_rank) == whole, (name, per_rank, whole)
        assert max(per_rank) <= 0.6 * whole, (name, per_rank, whole)
    assert runs[0]["row"]["report"]["sharding"] == "row"


@pytest.mark.slow  # several processes
def test_each_ranks_peak_rss_falls_by_about_half_the_tables(runs, cache_dir):
    """Measured on the processes (VmHWM), not summed from tensors: one
    process's peak with ~320 MiB of tables (in a process of its own), and
    each of 2 row-wise ranks' peak, which holds half the rows."""
    alone = distributed.launch(train_runs, 1, [("big", OmegaConf.to_container(config(cache_dir, **BIG)))])[0]["big"]
    tables = alone["table_bytes"]
    assert tables > 300 * 2**20
    peaks = runs[0]["big_row"]["report"]["peak_host_rss_bytes_per_rank"]
    held = [runs[r]["big_row"]["table_bytes"] for r in range(NPROC)]
    assert sum(held) == tables and max(held) - min(held) < tables / 1000  # row ranges differ by a row per table
    for rank, peak in enumerate(peaks):  # half the tables fewer, give or take a sixth of them
        assert peak < alone["peak_rss"] - tables / 3, (rank, peak / 2**20, alone["peak_rss"] / 2**20, tables / 2**20)


@pytest.mark.slow  # several processes
def test_pooled_rows_and_the_owners_update_are_bit_exact(runs):
    """Without the dense model in between: the pooled rows of every rank's
    slice equal one process's pooling of the whole batch (torch.equal
    table-wise; row-wise a bag split over shards adds its partial sums in
    rank order), and the rows the owners update from each rank's pooled
    gradients equal one process's update from the concatenated gradients
    (divided by the world size, as the loss scale implies), torch.equal for
    both: a row's gradient sums its bags' gradients in global batch order."""
    for rank in range(NPROC):
        for check, same in runs[rank]["exchange"].items():
            assert same, (rank, check)


# --- single-process units ---------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["table", "row", "auto"])
def test_the_ids_each_rank_is_sent_are_its_shards_bags_in_batch_order(world_size, kind):
    """plan_batch's payloads (cut in whole-batch ops) against the cut made
    shard by shard: for every destination, its shards' bag lengths, then
    their ids rebased to the shard, in batch order."""
    from bench.gpu_check import _check_batch
    from recsys_cli.data.batch import Batch
    from recsys_cli.embeddings.sharding import plan_shards

    features, vocab, dim = SHARDED_CHECK_TABLES
    plan = plan_shards(kind, list(zip(features, vocab)), {f: 16 for f in features}, world_size)
    collection = ShardedEmbeddingBagCollection(features, dim, plan, 0, None, None)
    kjt = _check_batch()
    route = collection.plan_batch(Batch(torch.zeros(kjt.stride, 1), kjt, torch.zeros(kjt.stride))).route
    lengths = kjt.lengths.view(len(features), kjt.stride)
    chunks = torch.split(kjt.values, lengths.sum(1).tolist())
    for rank in range(world_size):
        bags, ids = [], []
        for s in plan.owned(rank):
            k = features.index(s.table)
            bag_ids = torch.split(chunks[k], lengths[k].tolist())
            kept = [b[(b >= s.lo) & (b < s.hi)] - s.lo for b in bag_ids]
            bags.append(torch.tensor([len(b) for b in kept], dtype=torch.int64))
            ids.append(torch.cat(kept))
        expected = torch.cat(bags + ids) if bags else torch.zeros(0, dtype=torch.int64)
        assert torch.equal(route.payloads[rank], expected), (kind, world_size, rank)
        assert route.num_ids[rank] == sum(i.numel() for i in ids)


def test_sharding_needs_a_placement_kind_and_grad_sync(cache_dir):
    from recsys_cli.config import validate

    with pytest.raises(UserError, match="placement.kind=auto"):
        validate(config(cache_dir, placement__sharding="row", placement__kind="auto"))
    with pytest.raises(UserError, match="cache_avg"):
        validate(config(cache_dir, placement__sharding="table", trainer__embedding_sync="cache_avg"))


def test_a_plan_over_the_per_rank_budget_is_one_line_before_any_table_is_built():
    from types import SimpleNamespace

    place = SimpleNamespace(kind="device", sharding="table", device_memory_budget="1KiB")
    prec = SimpleNamespace(kind="fp32")
    with pytest.raises(UserError, match=r"rank \d of 2 would hold .* MiB of tables, over placement.device_memory_budget=1KiB"):
        build_sharded_embeddings(*SHARDED_CHECK_TABLES, place, prec, RowOptimizer("sgd"), torch.device("cpu"), 0, 0, 2,
                                 None)


def test_a_backend_without_all_to_all_is_one_line(monkeypatch):
    import torch.distributed as dist

    from recsys_cli.embeddings import sharded

    def lacking(*args, **kwargs):
        raise RuntimeError("ProcessGroupMPI does not support alltoall: not supported\n(more lines)")

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "mpi")
    monkeypatch.setattr(dist, "all_to_all_single", lacking)
    with pytest.raises(UserError, match="all_to_all, which the mpi backend lacks") as e:
        sharded._all_to_all(torch.zeros(4, dtype=torch.int64), [2, 2], [2, 2], None)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # several processes
def test_evaluate_and_export_read_a_sharded_checkpoint_on_one_process(checkpoints, runs, tmp_path):
    """The 2-rank checkpoint's shards assembled on one process: evaluate's
    test AUC is the one the 2 ranks measured at the same step, and the
    module export scores the same rows."""
    from recsys_cli.evaluate import EvaluateConfig, evaluate
    from recsys_cli.export import ExportConfig, export, load_scorer

    saved_at = checkpoints["two"] / f"step-{STEPS // 2:08d}.pt"
    result = evaluate(EvaluateConfig(checkpoint=str(saved_at), split="test", output=str(tmp_path / "eval"),
                                     progress=False, device="cpu"))
    assert result["auc"] == pytest.approx(runs[0]["half"]["evals"][-1], abs=1e-9)
    exported = export(ExportConfig(checkpoint=str(saved_at), format="module", output=str(tmp_path / "m.scorer.pt")))
    scorer = load_scorer(exported["output"])
    assert torch.isfinite(scorer(torch.zeros(3, 13, dtype=torch.int64), torch.zeros(3, 26, dtype=torch.int64))).all()


def test_routed_plans_are_pinned_where_the_device_reads_them():
    """CUDA runs pin the owner's plans on the routing thread (their copies stay
    asynchronous); the pin is the runtime's, here a recording one."""
    from types import SimpleNamespace

    from recsys_cli.train.strategies.sharded import routed_batches

    pinned = []

    class Plan:
        def pin_memory(self, pin):
            pinned.append(pin)
            return self

    embeddings = SimpleNamespace(route=lambda batch, group: SimpleNamespace(plans=[Plan(), Plan()]))
    out = list(routed_batches(range(3), 2, embeddings, None, pin="the runtime's pin"))
    assert len(out) == 2 and pinned == ["the runtime's pin"] * 4
    pinned.clear()
    assert len(list(routed_batches(range(3), 3, embeddings, None))) == 3 and not pinned  # CPU: nothing pinned


def test_a_rank_that_owns_no_shard_returns_pooled_rows_on_the_models_device(monkeypatch):
    """Table-wise sharding with more ranks than tables leaves a rank without
    a shard: its pooled rows (all received from the owners) must still be on
    the device the dense model runs on, not on the CPU. The device here is
    `meta` (no data), standing in for a GPU; the all-to-all is faked."""
    from types import SimpleNamespace

    from bench.gpu_check import _check_batch
    from recsys_cli.data.batch import Batch
    from recsys_cli.embeddings import sharded
    from recsys_cli.embeddings.sharding import plan_shards

    def exchange(send, send_splits, recv_splits, group):
        if send_splits == [2] * world:  # the sizes: every rank has a slice as large as this one's
            return send.clone()
        return torch.zeros(sum(recv_splits), dtype=send.dtype, device=send.device)  # ids, rows: zeros, where `send` is

    monkeypatch.setattr(sharded, "_all_to_all", exchange)
    features, vocab, dim = SHARDED_CHECK_TABLES
    world = len(features) + 1
    place = SimpleNamespace(kind="device", sharding="table", device_memory_budget=None)
    prec = SimpleNamespace(kind="fp32")
    plan = plan_shards("table", list(zip(features, vocab)), {f: 16 for f in features}, world)
    idle = next(r for r in range(world) if not plan.owned(r))
    collection = build_sharded_embeddings(features, vocab, dim, place, prec, RowOptimizer("sgd"), torch.device("meta"),
                                          0, idle, world, None)
    kjt = _check_batch()
    batch = collection.route(collection.plan_batch(Batch(torch.zeros(kjt.stride, 1), kjt, torch.zeros(kjt.stride))),
                             None)
    pooled = collection(batch)
    assert collection.local is None and pooled.device.type == "meta"
    assert pooled.shape == (kjt.stride, len(features), dim)
