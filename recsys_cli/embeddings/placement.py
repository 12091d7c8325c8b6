"""Placement: which tables live where, and the table groups that hold them.

Placement (where a table lives) and precision (what it holds) are separate
axes. Every table gets a placement from the config (default kind, then the
size rule, then per-table overrides); tables that share (placement,
precision) are fused into one group. A low-precision table always sits
behind an fp32 cache: with `lookahead` that is the lookahead cache, with any
other placement an on-demand cache of precision.cache_ratio of its rows.

Placements: `device` (alias `gpu`) keeps the store in device memory; `host`
keeps it in host memory (pinned on CUDA) and gathers the batch's rows there
and copies them to the device every step, writing their updates back; `uvm`
keeps it in host memory that the GPU addresses directly, so the gather and
the row update are kernels reading and writing the host pages over the bus
(no copy, no host gather; on CPU it is `host`); `lookahead` and `cache` put
host tables behind an fp32 device cache.

Admission (one owner per row, see cache.py): an fp32 table's cache admits
every row a batch needs; a low-precision table's cache admits what it has
room for and the store serves the rest, with lfu admission by use count in
an on-demand cache only, and a lookahead cache never admitting a row that a
batch in its window is served from the store.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from recsys_cli.device import runtime_for
from recsys_cli.embeddings.cache_size import cache_size
from recsys_cli.embeddings.collection import EmbeddingBagCollection
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.access_profile import measure_access
from recsys_cli.embeddings.placement_bytes import BUDGET_KEY, HOST_BUDGET_KEY, parse_bytes
from recsys_cli.embeddings.placement_search import TablePlacements, place_tables
from recsys_cli.embeddings.store import RowStore
from recsys_cli.embeddings.table_init import TableSpec, build_initial_rows
from recsys_cli.embeddings.tables import DirectGroup
from recsys_cli.errors import UserError

DEFAULT_CACHE_RATIO = {"fp16": 0.05, "int8": 0.05, "int4": 0.01}


ALIASES = {"gpu": "device"}


def canonical(kind: str) -> str:
    """A placement's name, with old names mapped (gpu)."""
    return ALIASES.get(kind, kind)


def table_placements(tables: list[TableSpec], placement) -> dict[str, str]:
    kind = canonical(placement.kind)
    out = {}
    for t in tables:
        p = kind
        if placement.device_max_rows is not None and t.num_rows <= placement.device_max_rows:
            p = "device"
        out[t.name] = p
    for name, p in placement.overrides.items():
        if name not in out:
            raise UserError(f"placement.overrides names table {name!r}; tables are {', '.join(out)}")
        out[name] = canonical(p)
    return out


def build_embeddings(
    features: list[str], vocab_sizes: list[int], dim: int, placement, precision, optimizer: RowOptimizer,
    device: torch.device, seed: int, placements: dict[str, str] | None = None,
    precisions: dict[str, str] | None = None, cache_rows: int | None = None,
    batch_ids: dict[str, int | None] | None = None, shards: list[TableSpec] | None = None,
    table_numbers: dict[str, int] | None = None,
) -> EmbeddingBagCollection:
    """One table per feature, named after it, grouped by (placement, precision).

    placements/precisions: per table, overriding the config (the placement search's
    choice); cache_rows: slots of the lookahead/cache group (or per
    placement kind, {"lookahead": n, "disk": m}), overriding placement.cache_rows;
    batch_ids: per table the most ids one batch holds (None: multi-hot), the
    floor of a ratio-sized cache (cache_size.py); shards: this rank's shards
    of a sharded run (sharding.py), one per feature, in place of whole
    tables; table_numbers: each table's number in the rounding keys (default:
    its feature's position; a shard keeps its whole table's)."""
    tables = shards or [TableSpec(f, n, dim) for f, n in zip(features, vocab_sizes)]
    numbers = table_numbers or {f: i for i, f in enumerate(features)}
    placements = placements or table_placements(tables, placement)
    precisions = precisions or {t.name: precision.kind for t in tables}
    groups: "OrderedDict[tuple[str, str], list[TableSpec]]" = OrderedDict()
    for t in tables:
        groups.setdefault((placements[t.name], precisions[t.name]), []).append(t)
    built = []
    for (kind, table_precision), specs in groups.items():
        table_rows = [(numbers[t.name], t.num_rows, t.first_row) for t in specs]  # rounding keys: the table, not its group
        rows = cache_rows.get(canonical(kind)) if isinstance(cache_rows, dict) else cache_rows
        if kind == "disk":  # built straight into its file, never whole in memory
            group = make_disk_group(specs, table_precision, table_rows, placement, precision, optimizer, device,
                                    seed, rows, batch_ids)
            built.append(([t.name for t in specs], group))
            continue
        group = make_group(kind, table_precision, specs, placement, precision, optimizer, device,
                           seed, rows, table_rows, batch_ids=batch_ids)
        built.append(([t.name for t in specs], group))
    return EmbeddingBagCollection(features, built, dim)


def make_group(kind, table_precision, specs, placement, precision, optimizer, device, seed, cache_rows=None,
               table_rows=None, runtime=None, batch_ids=None):
    """The group of tables `specs`, its store built in place: allocated once
    in its precision and location and filled chunk by chunk (no fp32 copy of
    the tables, no concatenation). The cache is sized before the store is built."""
    names = [t.name for t in specs]
    num_rows = sum(t.num_rows for t in specs)
    kind = canonical(kind)
    size = None
    if kind in ("lookahead", "cache"):
        size = cache_size([(t.name, t.num_rows) for t in specs],
                          cache_rows if cache_rows is not None else placement.cache_rows, placement.cache_ratio,
                          batch_ids, placement.window if kind == "lookahead" else 1)
    host = kind in ("host", "uvm", "lookahead", "cache")
    store_device = torch.device("cpu") if host else device
    runtime = runtime or runtime_for(device)
    # A host table on a CUDA run lives in pinned memory, allocated so and built in place: one copy, not two.
    empty = runtime.empty_pinned if host and runtime.pins_host else None
    store = RowStore(
        num_rows, specs[0].dim, optimizer.initial_state(num_rows, store_device, empty),
        table_precision, precision.rounding, seed, table_rows, empty, store_device,
    )
    build_initial_rows(specs, seed, store.write_initial, into=store.initial_view, workers=torch.get_num_threads())
    if kind == "uvm" and table_precision == "fp32" and runtime.pins_host:  # built on the host, then addressed by the GPU
        if not store.map_to_device(runtime.device_view, device):
            raise UserError(f"placement uvm: {device} cannot address host memory directly (no mapped pointer for "
                            "registered host memory): use placement=host, which copies the rows instead")
    args = dict(tables=specs, feature_tables=names, store=store, optimizer=optimizer, device=device)
    if kind in ("lookahead", "cache") or table_precision != "fp32":
        from recsys_cli.embeddings.cache import CachedGroup, cache_slots

        if size is not None:
            slots, why, policy = size.slots, size.why, placement.policy
        else:
            ratio = precision.cache_ratio or DEFAULT_CACHE_RATIO[table_precision]
            slots, why, policy = cache_slots(num_rows, None, ratio), f"precision cache_ratio={ratio:g}", precision.policy
        return CachedGroup(
            **args, store_tier="device" if kind == "device" else "host", cache_slots=slots, policy=policy,
            lookahead=kind == "lookahead", window=placement.window, admit_all=table_precision == "fp32", sizing=why,
        )
    return DirectGroup(**args, kind=kind)


def make_disk_group(specs, table_precision, table_rows, placement, precision, optimizer, device, seed,
                    cache_rows=None, batch_ids=None):
    """`disk`: the tables in a DiskRowStore (rows in their precision and
    optimizer state in a file under placement.disk_path, behind a host cache
    of placement.host_cache_rows / host_cache_ratio rows), behind the
    lookahead fp32 cache, whose prefetcher does the disk reads and
    write-backs on its own thread."""
    from recsys_cli.embeddings.cache import CachedGroup
    from recsys_cli.embeddings.disk_store import DiskRowStore

    size = cache_size([(t.name, t.num_rows) for t in specs],
                      cache_rows if cache_rows is not None else placement.cache_rows, placement.cache_ratio,
                      batch_ids, placement.window)
    num_rows = sum(t.num_rows for t in specs)
    host_rows = placement.host_cache_rows
    if host_rows is None:
        host_rows = int(round(num_rows * placement.host_cache_ratio))
    store = DiskRowStore(specs, [t[0] for t in table_rows], table_precision, precision.rounding, seed,
                         1 if optimizer.has_state else 0, optimizer.initial_accumulator, placement.disk_path,
                         host_rows, io_threads=placement.disk_io_threads)
    return CachedGroup(
        tables=specs, feature_tables=[t.name for t in specs], store=store, optimizer=optimizer, device=device,
        store_tier="host", cache_slots=size.slots, policy=placement.policy,
        lookahead=True, window=placement.window, admit_all=table_precision == "fp32", sizing=size.why,
    )


def measure_and_place(features: list[str], vocab_sizes: list[int], dim: int, placement, precision, optimizer: RowOptimizer,
                      sample_batches, device: torch.device) -> TablePlacements:
    """placement=auto: measure the access skew of a sample of training
    batches and let the placement search place every table within the device budget
    (and, with placement.host_memory_budget, the host budget: the rest on disk).
    On a CPU the device tier is host memory, so both budgets bound it: its
    budget is the smaller of the two (on CUDA, device_memory_budget alone)."""

    if not placement.device_memory_budget:
        raise UserError("placement=auto needs placement.device_memory_budget=SIZE (e.g. 64MiB, 2GiB)")
    budget, budget_key = parse_bytes(placement.device_memory_budget), BUDGET_KEY
    host_budget = (parse_bytes(placement.host_memory_budget, HOST_BUDGET_KEY)
                   if placement.host_memory_budget else None)
    if device.type == "cpu" and host_budget is not None and host_budget < budget:
        budget, budget_key = host_budget, HOST_BUDGET_KEY
    profile = measure_access(sample_batches, features, vocab_sizes)
    tables = [TableSpec(f, n, dim) for f, n in zip(features, vocab_sizes)]
    return place_tables(
        tables, profile.hot_rows(), budget, precision=precision.kind,
        optimizer_state_per_row=1 if optimizer.has_state else 0,
        batch_unique_rows=profile.batch_unique_rows, reads=profile.reads, policy=placement.policy,
        host_budget_bytes=host_budget, budget_key=budget_key,
        host_cache_ratio=placement.host_cache_ratio,
    )
