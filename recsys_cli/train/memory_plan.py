"""Memory refused up front: what a run will hold, against what the process may use.

`recsys train model=dlrm_v2 dataset.synthetic.cardinality_scale=4.0` asked
the allocator for 69 GB after 13 s and died in a 40-line traceback. Before
any table is built (and before the built-in synthetic data is generated:
its vocabularies follow from the config), `plan` adds up what the run will
hold, part by part, from the same sizes the groups allocate (TableGroup /
CachedGroup.memory, placement_bytes.py's byte model):

  tables            every table's rows in their precision, where they live
  optimizer state   row-wise Adagrad's accumulator beside each row
  caches            the fp32 device cache slots, a disk table's host cache
  cache indexes     slot maps, victim order, LFU use counts (host)
  model             the dense MLPs: weights, gradients, optimizer state,
                    one batch's activations
  loader buffers    the batches read ahead, a row group being decoded
  build scratch     what building the tables holds beside them: a chunk of
                    fp32 rows per build thread and, for a low-precision
                    table, the quantizer's temporaries (measured: about 100
                    bytes an element of a chunk, kept by the C allocator's
                    per-thread arenas until the build ends)
  checkpoint peak   the dense state a checkpoint copies (tables are streamed)

`available` says what the process may still take: host memory is the
smaller of MemAvailable and the room left under the cgroup's limit; on CUDA
the device's free memory (torch.cuda.mem_get_info). `check` refuses a run
whose plan does not fit in one line with the numbers and the cheapest
setting that would fit: a lower precision behind a cache, disk placement,
or the tables sharded over N processes on N machines.

On CPU the device is the host: a device table's bytes are host bytes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from recsys_cli.embeddings.placement_bytes import (HOST_CACHE_BYTES_PER_SLOT, cache_index_bytes, device_row_bytes,
                                                   host_row_bytes, slot_index_bytes)
from recsys_cli.errors import UserError
from recsys_cli.units import format_bytes

PARTS = ("tables", "optimizer state", "caches", "cache indexes", "model", "loader buffers", "build scratch",
         "checkpoint peak")
DEFAULT_CACHE_RATIO = {"fp16": 0.05, "int8": 0.05, "int4": 0.01}  # embeddings/placement.py's (no torch here)
CACHED = ("lookahead", "cache", "disk")
CHUNK_ELEMENTS = 1 << 20  # table_init.CHUNK_ELEMENTS: fp32 values a build thread holds at once
QUANTIZE_SCRATCH_BYTES = 100  # a quantized build's temporaries per element of a chunk (measured, see above)
# The loader's fixed cost: pyarrow's memory pool and its reading thread's
# arena, measured at 25-40 MB whatever the batch.
LOADER_FIXED_BYTES = 32 << 20
# Headroom the plan keeps for what it does not itemise (Python objects, the
# allocator's fragmentation, thread stacks touched): refused only past this.
HEADROOM = 1.05


@dataclass
class Plan:
    host: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    device: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    on_device: bool = False  # a CUDA run: device bytes are the GPU's

    def add(self, part: str, where: str, nbytes: int) -> None:
        target = self.device if where == "device" and self.on_device else self.host
        target[part] += int(nbytes)

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    def parts(self, where: str) -> str:
        d = self.device if where == "device" else self.host
        return ", ".join(f"{name} {format_bytes(n)}" for name, n in d.items() if n)

    def as_dict(self) -> dict:
        return {"host": dict(self.host), "device": dict(self.device) if self.on_device else None,
                "host_bytes": self.host_bytes, "device_bytes": self.device_bytes if self.on_device else None}


@dataclass(frozen=True)
class Table:
    name: str
    num_rows: int
    multi_hot: bool = False


def _get(node, key: str, default=None):
    try:
        value = node[key] if isinstance(node, dict) else getattr(node, key)
    except (KeyError, AttributeError):
        return default
    return default if value is None else value


def plan(cfg, tables: list[Table], on_device: bool, world_size: int = 1, sharded: bool = False,
         placements: dict[str, str] | None = None, precisions: dict[str, str] | None = None,
         cache_rows: dict | None = None) -> Plan:
    """What the run of `cfg` over `tables` will hold (one process: its shard of
    sharded tables). placements/precisions/cache_rows: the placement search's
    choice (placement=auto), else the config's."""
    from recsys_cli.embeddings.placement import ALIASES

    p = Plan(on_device=on_device)
    dim = int(cfg.model.embedding_dim)
    state = 1 if cfg.optimizer.name != "sgd" else 0
    pl, pr, tc = cfg.placement, cfg.precision, cfg.trainer
    batch = int(tc.batch_size) // max(world_size, 1)
    kind = ALIASES.get(pl.kind, pl.kind)
    groups: dict[tuple[str, str], list[Table]] = {}
    for t in tables:
        if placements is not None:
            where = placements[t.name]
        else:
            where = kind
            if pl.device_max_rows is not None and t.num_rows <= pl.device_max_rows:
                where = "device"
            where = ALIASES.get(pl.overrides.get(t.name, where), pl.overrides.get(t.name, where))
        precision = precisions[t.name] if precisions is not None else pr.kind
        rows = -(-t.num_rows // world_size) if sharded else t.num_rows  # a rank's shard (row-wise: at most this)
        groups.setdefault((where, precision), []).append(Table(t.name, rows, t.multi_hot))
    scratch = 0
    for (where, precision), specs in groups.items():
        rows = sum(t.num_rows for t in specs)
        asked = cache_rows.get(where) if isinstance(cache_rows, dict) else None
        _group(p, where, precision, specs, rows, dim, state, pl, pr, batch, asked)
        scratch = max(scratch, _build_scratch(where, precision, rows, dim, on_device))
    p.add("build scratch", "host", scratch)  # groups are built one after another
    _model(p, cfg, len(tables), dim, batch, state)
    _loader(p, cfg, len(tables), batch)
    return p


def _build_scratch(where: str, precision: str, rows: int, dim: int, on_device: bool) -> int:
    """What building a group holds beside its rows (table_init.build_initial_rows)."""
    import torch

    if precision == "fp32" and where != "disk" and not (where == "device" and on_device):
        return 0  # built in place: the host rows are the build's buffer
    workers = max(1, min(torch.get_num_threads(), -(-rows * dim // CHUNK_ELEMENTS)))
    per_element = 4 + (QUANTIZE_SCRATCH_BYTES if precision != "fp32" else 0)
    return workers * min(CHUNK_ELEMENTS, rows * dim) * per_element


def _cache_slots(specs: list[Table], rows: int, asked: int | None, pl, batch: int, held: int) -> int:
    """cache_size.py's rule, without importing torch."""
    if asked is not None:
        return max(1, min(rows, asked))
    if pl.cache_rows is not None:
        return max(1, min(rows, int(pl.cache_rows)))
    by_ratio = max(1, min(rows, int(round(rows * pl.cache_ratio))))
    floor = min(rows, sum(min(t.num_rows, held * batch) for t in specs if not t.multi_hot))
    return max(by_ratio, floor)


def _group(p: Plan, where: str, precision: str, specs: list[Table], rows: int, dim: int, state: int, pl, pr,
           batch: int, asked: int | None) -> None:
    values = host_row_bytes(dim, precision, 0)
    if where == "disk":  # rows in a file; in memory: the host cache and its index
        host_rows = pl.host_cache_rows if pl.host_cache_rows is not None else int(round(rows * pl.host_cache_ratio))
        p.add("caches", "host", host_rows * (values + state * 4 + HOST_CACHE_BYTES_PER_SLOT))
        p.add("cache indexes", "host", slot_index_bytes(host_rows, rows))
    else:
        store = "device" if where == "device" else "host"
        p.add("tables", store, rows * values)
        p.add("optimizer state", store, rows * state * 4)
    if where in CACHED or precision != "fp32":
        if where in CACHED:
            slots = _cache_slots(specs, rows, asked, pl, batch, int(pl.window) if where != "cache" else 1)
        else:  # a low-precision table's own on-demand cache
            ratio = pr.cache_ratio or DEFAULT_CACHE_RATIO[precision]
            slots = max(1, min(rows, int(round(rows * ratio))))
        p.add("caches", "device", slots * device_row_bytes(dim, state))
        index = cache_index_bytes(slots, rows)
        policy = pl.policy if where in CACHED else pr.policy
        if where not in ("lookahead", "disk") and precision != "fp32" and policy == "lfu":
            index += rows * 4 + slots * 6  # LFU admission: every row's use count, its slot order's scratch
        p.add("cache indexes", "host", index)


def mlp_params(widths: list[int]) -> int:
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def _model(p: Plan, cfg, num_sparse: int, dim: int, batch: int, state: int) -> None:
    m = cfg.model
    bottom, top = [13, *m.bottom_mlp], list(m.top_mlp)
    if m.interaction == "dot":
        n = num_sparse + 1
        top_in = bottom[-1] + n * (n - 1) // 2
    else:
        top_in = bottom[-1] + num_sparse * dim
    params = mlp_params(bottom) + mlp_params([top_in, *top])
    if m.interaction == "dcn":
        params += m.dcn_layers * (top_in * m.dcn_rank + m.dcn_rank * top_in + top_in)
    dense_state = 1 if cfg.optimizer.name != "sgd" else 0
    weights = params * 4
    p.add("model", "device", weights * (2 + dense_state))  # weights, gradients, Adagrad's sums
    widths = [*bottom, top_in, *top] + ([top_in] * 2 * m.dcn_layers if m.interaction == "dcn" else [])
    pooled = num_sparse * dim + (num_sparse + 1) ** 2 if m.interaction == "dot" else num_sparse * dim
    p.add("model", "device", 3 * batch * (sum(widths) + pooled) * 4)  # activations, their gradients, scratch
    p.add("checkpoint peak", "host", weights * (1 + dense_state))  # the dense state a checkpoint copies
    del state


def _loader(p: Plan, cfg, num_sparse: int, batch: int) -> None:
    # A batch: 13 dense floats, a label, per feature an id (int64) and its length, and its plan's slots.
    per_row = 13 * 4 + 4 + num_sparse * (8 + 4 + 8)
    depth = int(cfg.trainer.loader_queue_depth) + 2  # queued, being made, being trained on
    evaluation = max(int(cfg.trainer.eval_batch_size), batch)
    p.add("loader buffers", "host", per_row * (depth * batch + 2 * evaluation) + LOADER_FIXED_BYTES)


def tables_of(cfg) -> list[Table] | None:
    """The tables of `cfg`'s dataset: from its manifest, or for the built-in
    synthetic data from its config (nothing generated); None when the
    dataset cannot be read (training_data says why)."""
    from omegaconf import OmegaConf

    dataset = cfg.dataset
    try:
        path = dataset.path
    except Exception:  # a mandatory path left unset
        return None
    if path:
        from data_tools.manifest import load_manifest

        try:
            m = load_manifest(Path(path).expanduser())
        except Exception:
            return None
        return [Table(f.name, f.vocab_size, f.multi_hot) for f in m.sparse_features]
    if not str(dataset.name).startswith("synthetic"):
        return None
    from data_tools.synthetic import CRITEO_SPARSE, SyntheticConfig, vocab_sizes

    try:
        values = OmegaConf.to_container(dataset.synthetic, resolve=True)
        assert isinstance(values, dict)
        syn = SyntheticConfig(**{str(k): v for k, v in values.items()})
        sizes = vocab_sizes(syn)
    except Exception:
        return None
    return ([Table(n, v) for n, v in zip(CRITEO_SPARSE, sizes)]
            + [Table(f"H{i}", syn.multi_hot_vocab, True) for i in range(1, syn.multi_hot_features + 1)])


# --- what the process may use --------------------------------------------------------------------


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_room(root: Path = Path("/sys/fs/cgroup"),
                proc_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[int, str] | None:
    """Bytes left under this process's cgroup memory limit, if it has one (v2, then v1)."""
    candidates = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0":
                candidates.append((root / path.lstrip("/"), "memory.max", "memory.current"))
            elif "memory" in controllers.split(","):
                candidates.append((root / "memory" / path.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes"))
    except (OSError, ValueError):
        pass
    candidates += [(root, "memory.max", "memory.current"), (root / "memory", "memory.limit_in_bytes",
                                                            "memory.usage_in_bytes")]
    for directory, limit_name, usage_name in candidates:
        limit = _read_int(directory / limit_name)
        if limit is None or limit >= 1 << 60:  # "max", or v1's "unlimited"
            continue
        usage = _read_int(directory / usage_name) or 0
        return max(0, limit - usage), f"the cgroup's limit {format_bytes(limit)}, {format_bytes(usage)} in use"
    return None


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class Room:
    host: int | None
    host_why: str
    device: int | None = None  # CUDA: free device bytes
    device_why: str = ""


def available(device=None) -> Room:
    """What this process may still take: host (the smaller of MemAvailable and
    the cgroup's room) and, on CUDA, the device's free memory."""
    host, why = None, ""
    free = mem_available()
    if free is not None:
        host, why = free, "MemAvailable"
    room = cgroup_room()
    if room is not None and (host is None or room[0] < host):
        host, why = room
    env = os.environ.get("RECSYS_MEMORY_LIMIT")  # a scheduler's (or a test's) own limit: 64GiB, 500MB, bytes
    if env:
        from recsys_cli.embeddings.placement_bytes import parse_bytes

        limit = parse_bytes(env, "RECSYS_MEMORY_LIMIT")
        if host is None or limit < host:
            host, why = limit, f"RECSYS_MEMORY_LIMIT={env}"
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        free_device, _ = torch.cuda.mem_get_info(device)
        return Room(host, why, free_device, f"free on {device}")
    return Room(host, why)


# --- the check -----------------------------------------------------------------------------------

# Cheapest first: what each costs the run (a lower precision costs the least
# AUC; disk costs speed; sharding needs machines).
ALTERNATIVES: list[tuple[str, dict]] = [
    ("placement=lookahead", {"placement.kind": "lookahead"}),
    ("placement=lookahead precision=int8", {"placement.kind": "lookahead", "precision.kind": "int8"}),
    ("placement=lookahead precision=int4", {"placement.kind": "lookahead", "precision.kind": "int4"}),
    ("placement=disk", {"placement.kind": "disk"}),
    ("placement=disk precision=int4", {"placement.kind": "disk", "precision.kind": "int4"}),
]


def fits(p: Plan, room: Room) -> bool:
    host_ok = room.host is None or p.host_bytes * HEADROOM <= room.host
    device_ok = room.device is None or p.device_bytes * HEADROOM <= room.device
    return host_ok and device_ok


def check(cfg, tables: list[Table], room: Room, on_device: bool, world_size: int = 1, sharded: bool = False,
          **chosen) -> Plan:
    """The plan of this run; a UserError in one line when it does not fit
    `room`, naming the numbers and the cheapest setting that would fit."""
    from omegaconf import OmegaConf

    p = plan(cfg, tables, on_device, world_size, sharded, **chosen)
    if fits(p, room):
        return p
    where, need, have, why = ("host", p.host_bytes, room.host, room.host_why)
    if room.host is None or p.host_bytes * HEADROOM <= room.host:
        where, need, have, why = ("device", p.device_bytes, room.device, room.device_why)
    suggestion = None
    current = (cfg.placement.kind, cfg.precision.kind)
    for words, changes in ALTERNATIVES:
        if (changes.get("placement.kind", current[0]), changes.get("precision.kind", current[1])) == current:
            continue
        other = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        for key, value in changes.items():
            OmegaConf.update(other, key, value)
        other.precision.cache_ratio = None  # the precision's own default where it applies
        q = plan(other, tables, on_device, world_size, sharded)
        if fits(q, room):
            suggestion = f"{words} would fit ({format_bytes(q.host_bytes)} host" + (
                f", {format_bytes(q.device_bytes)} device)" if on_device else ")")
            break
    if suggestion is None:
        n = math.ceil(need * HEADROOM / max(have or 1, 1))
        suggestion = (f"no setting fits one process here: shard the tables over {n} or more processes on as many "
                      "machines (trainer.nproc, placement.sharding=row) or use a machine with more memory")
    raise UserError(
        f"not enough memory: the run needs about {format_bytes(need)} of {where} memory ({p.parts(where)}) and this "
        f"process may use {format_bytes(have)} ({why}); {suggestion}. Nothing was built"
    )
