"""Structured configs: the schema every YAML file in configs/ is checked against.

Each config group (dataset, model, placement, precision, dedup, trainer,
optimizer) has one dataclass here; the YAML files only choose values. A key
that is not a field, or a value of the wrong type, fails at start-up with the
key's full name. Closed choices are Enums (as TorchRec's PoolingType), so
OmegaConf itself rejects a value that is not one of them, naming the key and
the choices; the members are strings (`PlacementKind.device == "device"`),
so code, YAML files and overrides keep using the plain words. `validate`,
which the trainer calls before it does any work, checks what a type cannot
express (ranges, combinations) and the choices again for configs built
without the schema.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from data_tools.synthetic import SyntheticConfig
from data_tools.synthetic import validate as validate_synthetic
from recsys_cli.errors import UserError


class Choice(str, Enum):
    """A closed choice whose members are their own names as strings: equal to,
    hashed, formatted and repr'd as the plain word, so messages and files
    (summary.json, checkpoints) read as before."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    __repr__ = str.__repr__


class Interaction(Choice):
    dot = "dot"
    cat = "cat"
    dcn = "dcn"  # DCNv2 low-rank cross layers


class MLPInit(Choice):
    dlrm = "dlrm"  # the reference dlrm_s_pytorch's normal draws
    torch = "torch"  # nn.Linear's default


class DensePrecision(Choice):
    fp32 = "fp32"
    bf16 = "bf16"  # autocast of the MLPs (docs/explanation/performance.md); needs a bf16 path (device.require_bf16)


class PlacementKind(Choice):
    device = "device"
    gpu = "gpu"  # old name of device
    host = "host"
    uvm = "uvm"  # host memory the GPU addresses directly (CPU: host)
    lookahead = "lookahead"
    cache = "cache"
    disk = "disk"  # host cache in front of rows on disk
    auto = "auto"  # last: a table's own placement (placement.overrides) cannot be auto


class Sharding(Choice):
    replicated = "replicated"  # every rank holds every table (trainer.embedding_sync keeps them in step)
    table = "table"  # each table whole on one rank
    row = "row"  # each table in contiguous row ranges, one per rank
    auto = "auto"  # the planner picks per table


class CachePolicy(Choice):
    lru = "lru"
    lfu = "lfu"


class PrecisionKind(Choice):
    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"


class Rounding(Choice):
    stochastic = "stochastic"
    nearest = "nearest"


class OptimizerName(Choice):
    sgd = "sgd"
    adagrad = "adagrad"


class DenseKernel(Choice):
    foreach = "foreach"
    fused = "fused"


class ScheduleKind(Choice):
    constant = "constant"
    warmup_poly = "warmup_poly"


class DeviceChoice(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class EmbeddingSyncMode(Choice):
    grad = "grad"
    cache_avg = "cache_avg"


class LoggerKind(Choice):
    jsonl = "jsonl"
    tensorboard = "tensorboard"


class MonitorMetric(Choice):
    """A validation metric the loop may watch (train/loop_control.py)."""

    auc = "auc"
    accuracy = "accuracy"
    logloss = "logloss"
    normalized_entropy = "normalized_entropy"


class MonitorMode(Choice):
    auto = "auto"  # the metric's own direction: auc and accuracy max, logloss and normalized_entropy min
    max = "max"
    min = "min"


@dataclass
class DatasetConfig:
    name: str = "synthetic"  # the dataset's name (the dataset= option chosen), shown in summaries
    # A preprocessed dataset directory (manifest.json + shards). Empty for the
    # synthetic dataset, which is generated on first use into cache_dir.
    path: Optional[str] = None
    # Where the synthetic dataset is generated (unset: $RECSYS_CACHE or ~/.cache/recsys).
    cache_dir: Optional[str] = None
    # The synthetic data (used when path is unset).
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class ModelConfig:
    name: str = "dlrm_small"  # the model's name (the model= option chosen)
    embedding_dim: int = 16  # width of every embedding row
    # Hidden and output widths; the bottom MLP's input is the 13 dense
    # features and its output must equal embedding_dim for the dot interaction.
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [64, 1])  # top MLP widths; the last is 1 (the logit)
    interaction: Interaction = Interaction.dot  # dot (DLRM) | cat | dcn (DCNv2 low-rank cross layers)
    dcn_layers: int = 3  # dcn: cross layers
    dcn_rank: int = 512  # dcn: rank of each cross layer's weight
    # MLP initialisation: dlrm (the reference dlrm_s_pytorch's normal draws) | torch (nn.Linear's default).
    init: MLPInit = MLPInit.dlrm
    # When set, the dataset's sparse features must be exactly these.
    features: Optional[list[str]] = None
    # Speed options for the dense half (docs/explanation/performance.md): torch.compile of the
    # MLPs and interaction for training steps, and bf16 autocast of the MLPs.
    # Both off by default: the default is the exact fp32 path.
    compile: bool = False
    dense_precision: DensePrecision = DensePrecision.fp32  # fp32 | bf16 (autocast of the MLPs)


@dataclass
class PlacementConfig:
    # Where the tables live: device | gpu (old name of device) | host | uvm |
    # lookahead | cache | disk | auto (the budget search, per table).
    kind: PlacementKind = PlacementKind.device
    # Cache size in rows for lookahead/cache; when unset, cache_ratio of all rows.
    cache_rows: Optional[int] = None
    cache_ratio: float = 0.05  # lookahead/cache/disk: the device cache's share of all rows
    window: int = 4  # lookahead: batches prefetched ahead of the trainer
    policy: CachePolicy = CachePolicy.lru  # the cache's victim policy: lru | lfu
    # Per-table placement: {table name: placement}, applied after the size rule;
    # a table is added with +placement.overrides.C3=disk (the + adds a key).
    overrides: dict[str, str] = field(default_factory=dict)
    # Tables with at most this many rows stay on the device whatever `kind` says.
    device_max_rows: Optional[int] = None
    # auto: bytes of device memory the embeddings may use ("64MiB", "2GiB"); with
    # placement.sharding over several processes, the most one rank's shards may take.
    device_memory_budget: Optional[str] = None
    # disk: the directory of the tables' files (a fresh subdirectory, deleted
    # at exit; unset: the system's temporary directory), and the host cache of
    # rows in front of them (rows; unset: host_cache_ratio of all rows).
    disk_path: Optional[str] = None
    host_cache_rows: Optional[int] = None  # disk: host cache size in rows (unset: host_cache_ratio)
    host_cache_ratio: float = 0.05  # disk: the host cache's share of all rows
    # disk: reads in flight at once (threads issuing the coalesced preads).
    disk_io_threads: int = 8
    # auto: bytes of host memory the tables may use; tables that do not fit go to disk.
    # On a CPU the device tier is host memory too: its budget is the smaller of this and device_memory_budget.
    host_memory_budget: Optional[str] = None
    # With trainer.nproc > 1: every table on every rank, or split over the ranks
    # (embeddings/sharding.py); a shard sits wherever `kind` puts its table.
    sharding: Sharding = Sharding.replicated


@dataclass
class PrecisionConfig:
    kind: PrecisionKind = PrecisionKind.fp32  # how table rows are stored: fp32 | fp16 | int8 | int4
    rounding: Rounding = Rounding.stochastic  # stochastic | nearest: how updated rows are rounded to kind
    # fp32 cache in front of a low-precision table; unset: the paper's defaults
    # (0.05 for int8, 0.01 for int4, 0.05 for fp16).
    cache_ratio: Optional[float] = None
    policy: CachePolicy = CachePolicy.lru  # that fp32 cache's victim policy: lru | lfu


@dataclass
class DedupConfig:
    enabled: bool = False  # RecD: batches carry each feature's unique bags plus an inverse index
    # Shuffle whole sessions instead of samples, so a batch holds whole
    # sessions; unset: on exactly when dedup is (set it to compare on vs off
    # on the same batches).
    keep_sessions: Optional[bool] = None


@dataclass
class OptimizerConfig:
    # sgd: SGD for dense and rows; adagrad: Adagrad for dense parameters and
    # row-wise Adagrad (one accumulator per row) for embedding rows.
    name: OptimizerName = OptimizerName.sgd
    lr: float = 0.1  # learning rate (of dense parameters and rows alike)
    eps: float = 1e-8  # adagrad: added to the root of the accumulator
    initial_accumulator: float = 0.0  # adagrad: the accumulators' starting value
    # adagrad: the dense parameters' update. foreach: torch.optim.Adagrad(foreach=True)'s
    # bits, four passes over each cache-sized piece; fused: torch's one-pass kernel
    # (Adagrad(fused=True)'s bits, CPU and CUDA), 1.7x faster in a dlrm_v2 step, another
    # rounding of the same update, so a run's numbers differ from foreach's (train/dense_optim.py)
    dense_kernel: DenseKernel = DenseKernel.foreach
    # Learning-rate schedule for dense and row updates alike (train/schedule.py):
    # constant, or warmup_poly: linear warmup over warmup_steps, then from
    # decay_start_step (unset: the end of warmup) a polynomial decay of power
    # decay_power over decay_steps (unset: to the last step of the run), never
    # below min_lr, held at its last value afterwards.
    schedule: ScheduleKind = ScheduleKind.constant
    warmup_steps: int = 0  # warmup_poly: steps of linear warmup to lr
    decay_start_step: Optional[int] = None  # warmup_poly: the first step of the decay (unset: the end of warmup)
    decay_steps: Optional[int] = None  # warmup_poly: steps the decay lasts (unset: to the last step)
    decay_power: float = 2.0  # warmup_poly: the power of the polynomial decay
    min_lr: float = 1e-7  # warmup_poly: the decay never goes below this


@dataclass
class TrainerConfig:
    batch_size: int = 256  # examples per optimizer step (with trainer.nproc > 1: all processes together)
    # Examples per evaluation batch. 1024, not 4096: half the evaluation's working set (about
    # 150 vs 300 MiB on a Kaggle-sized split) for 48 vs 44-46 s (BENCHMARKS "Evaluation memory by phase").
    eval_batch_size: int = 1024
    epochs: int = 1  # passes over the training split
    max_steps: Optional[int] = None  # stop after this many steps (unset: after the epochs)
    # Validation every N steps (unset: never mid-epoch); it also runs at the end of
    # the run, and of each epoch with eval_each_epoch.
    eval_every: Optional[int] = None
    log_every: int = 50  # steps between progress lines (and metrics.jsonl records)
    checkpoint_every: Optional[int] = 1000  # a checkpoint every N steps (null: none during the run)
    final_checkpoint: bool = True  # also write one at the end of the run (false: a run that keeps no model)
    checkpoint_dir: Optional[str] = None  # where checkpoints go (default: <run dir>/checkpoints)
    # "last" resumes from checkpoint_dir's latest checkpoint ("true" too), a path
    # from that checkpoint (file or directory); `recsys train` takes the resumed
    # run's own overrides (its .hydra/overrides.yaml), an override given again wins.
    resume: Optional[str] = None
    # Start a new run from this checkpoint's weights and optimizer state (a
    # file or directory) on a dataset with the same vocabulary, e.g. the next
    # day; unlike resume, the step count, data position and RNGs start afresh.
    init_from: Optional[str] = None
    device: DeviceChoice = DeviceChoice.auto  # auto (cuda when there is one) | cpu | cuda
    seed: int = 0  # seeds the model's initialisation, the shuffle and every random draw
    nproc: int = 1  # training processes on this machine (data parallel; see placement.sharding)
    # More processes than cores is refused (they only compete for the cores);
    # true starts them anyway (train/distributed.check_process_count).
    oversubscribe: bool = False
    # Several processes: grad (exact: row gradients averaged with the dense
    # ones) | cache_avg (cDLRM: cache replicas averaged every sync_every steps).
    embedding_sync: EmbeddingSyncMode = EmbeddingSyncMode.grad
    sync_every: int = 1  # cache_avg: steps between averages of the touched rows
    # Seconds a collective may wait for its peers before the run fails
    # (multi-process runs: a rank that hangs cannot hang the others forever).
    dist_timeout: float = 120.0
    progress: bool = True  # a progress bar on a terminal (progress lines otherwise)
    # torch compute (intra-op) threads while training; unset: the rule of
    # train/threads.py: the cores this process may use (shared among the
    # machine's processes), all of them for a wide step (matrix products of
    # 4e8 multiply-adds or more), else minus one per busy background thread
    # (loader, prefetcher), at least one.
    threads: Optional[int] = None
    loader_queue_depth: int = 8  # batches the background loader may hold ready
    # metrics.jsonl is always written; tensorboard also writes the same scalars
    # as TensorBoard events in <run dir>/tensorboard (pip install tensorboard, or
    # pip install '.[tensorboard]' in recsys's checkout).
    logger: LoggerKind = LoggerKind.jsonl
    # The last partial batch of each epoch: dropped (true, the loader's
    # default, said at start-up) or trained on as a smaller batch (false).
    drop_last: bool = True
    # Validation at the end of every epoch (besides every eval_every steps
    # and the end of the run).
    eval_each_epoch: bool = True
    # Checkpoints kept: the newest keep_last, and with keep_best the one of the
    # best validation `monitor` so far (checkpoints/best.json names it).
    keep_last: int = 2
    keep_best: bool = False  # also keep the checkpoint of the best `monitor` so far
    # The validation metric watched: auc | accuracy | logloss | normalized_entropy.
    monitor: MonitorMetric = MonitorMetric.auc
    # Better is: auto (auc and accuracy max, logloss and normalized_entropy min) | max | min.
    monitor_mode: MonitorMode = MonitorMode.auto
    # Stop when `monitor` has not improved by more than early_stop_min_delta
    # in early_stop_patience validations (Lightning's EarlyStopping); stop
    # when the validation AUC reaches stop_at_auc (dlrm's --mlperf-auc-threshold).
    early_stop_patience: Optional[int] = None
    early_stop_min_delta: float = 0.0  # the least change of `monitor` that counts as an improvement
    stop_at_auc: Optional[float] = None  # stop once the validation AUC reaches this (unset: never)


@dataclass
class TrainConfig:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


PLACEMENTS = tuple(k.value for k in PlacementKind)  # gpu: old name of device
PRECISIONS = tuple(k.value for k in PrecisionKind)
CHOICES: dict[str, type[Choice]] = {
    "model.interaction": Interaction,
    "model.init": MLPInit,
    "model.dense_precision": DensePrecision,
    "placement.kind": PlacementKind,
    "placement.policy": CachePolicy,
    "placement.sharding": Sharding,
    "precision.kind": PrecisionKind,
    "precision.rounding": Rounding,
    "precision.policy": CachePolicy,
    "optimizer.name": OptimizerName,
    "optimizer.schedule": ScheduleKind,
    "optimizer.dense_kernel": DenseKernel,
    "trainer.device": DeviceChoice,
    "trainer.embedding_sync": EmbeddingSyncMode,
    "trainer.logger": LoggerKind,
    "trainer.monitor": MonitorMetric,
    "trainer.monitor_mode": MonitorMode,
}


@dataclass(frozen=True)
class Range:
    """The numbers a key may hold: finite, at least `low` (above it when
    `open_low`), at most `high`; None only where the key may be unset.
    A list key's every element is checked."""

    low: float
    open_low: bool = False
    high: float = math.inf
    unset: bool = False  # None allowed (the key's default meaning)

    def check(self, key: str, value: Any) -> None:
        if value is None:
            if not self.unset:
                raise UserError(f"{key} must be set, got null")
            return
        if isinstance(value, (list, tuple)) or (hasattr(value, "__len__") and not isinstance(value, str)):
            for v in value:
                if not self.holds(v):
                    raise UserError(f"{key} must hold numbers {self.words()}, got {list(value)}")
            return
        if not self.holds(value):
            raise UserError(f"{key} must be {self.words()}{' (or unset)' if self.unset else ''}, got {value}")

    def holds(self, value: float) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return (value > self.low if self.open_low else value >= self.low) and value <= self.high

    def words(self) -> str:
        bound = f"> {self.low:g}" if self.open_low else f">= {self.low:g}"
        if self.high == math.inf:
            return bound
        return f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"


COUNT = Range(1)  # how many: at least one
STEPS = Range(1, unset=True)  # every N steps / at most N steps; unset: never / no limit
RATIO = Range(0, open_low=True, high=1)
POSITIVE = Range(0, open_low=True)
# Every int and float of the schema but dataset.synthetic.* (data_tools.synthetic.validate
# checks those); tests/test_configs.py walks the schema and fails on a key missing here.
RANGES: dict[str, Range] = {
    "model.embedding_dim": COUNT,
    "model.bottom_mlp": COUNT,
    "model.top_mlp": COUNT,
    "model.dcn_layers": COUNT,
    "model.dcn_rank": COUNT,
    "placement.cache_rows": Range(1, unset=True),
    "placement.cache_ratio": RATIO,
    "placement.window": COUNT,
    "placement.device_max_rows": Range(0, unset=True),
    "placement.host_cache_rows": Range(1, unset=True),
    "placement.host_cache_ratio": RATIO,
    "placement.disk_io_threads": COUNT,
    "precision.cache_ratio": Range(0, open_low=True, high=1, unset=True),  # unset: the precision's default
    "optimizer.lr": POSITIVE,
    "optimizer.eps": POSITIVE,
    "optimizer.initial_accumulator": Range(0),
    "optimizer.warmup_steps": Range(0),
    "optimizer.decay_start_step": Range(0, unset=True),
    "optimizer.decay_steps": Range(0, unset=True),
    "optimizer.decay_power": POSITIVE,
    "optimizer.min_lr": Range(0),
    "trainer.batch_size": COUNT,
    "trainer.eval_batch_size": COUNT,
    "trainer.epochs": COUNT,
    "trainer.max_steps": STEPS,
    "trainer.eval_every": STEPS,
    "trainer.log_every": COUNT,
    "trainer.checkpoint_every": STEPS,
    "trainer.seed": Range(0),
    "trainer.nproc": COUNT,
    "trainer.sync_every": COUNT,
    "trainer.dist_timeout": POSITIVE,  # seconds
    "trainer.threads": Range(1, unset=True),  # unset: the cores left to compute (train/threads.py)
    "trainer.loader_queue_depth": COUNT,
    "trainer.keep_last": COUNT,
    "trainer.early_stop_patience": Range(1, unset=True),  # validations without improvement; unset: never stop
    "trainer.early_stop_min_delta": Range(0),
    "trainer.stop_at_auc": Range(0, open_low=True, high=1, unset=True),
}


# A partial global batch would give the ranks unequal (or empty) slices,
# which the gradient average and the row planning of the strategies assume away.
DROP_LAST_RANKS = ("trainer.drop_last=false trains on the last partial batch in one process only; "
                   "with several processes keep trainer.drop_last=true")


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_ranges(cfg: Any, ranges: dict[str, Range]) -> None:
    """Each (dotted) key of `ranges` within its Range; UserError naming the first that is not."""
    for key, limits in ranges.items():
        limits.check(key, _get(cfg, key))


def validate(cfg: Any) -> None:
    """Check the values a type cannot express; raise UserError naming the key."""
    for key, choice in CHOICES.items():  # the schema checks these; a config built without it is checked here
        value, allowed = _get(cfg, key), [c.value for c in choice]
        if value not in allowed:
            raise UserError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    for name, kind in cfg.placement.overrides.items():
        if kind not in PLACEMENTS[:-1]:
            raise UserError(f"placement.overrides.{name}={kind!r} is not one of {', '.join(PLACEMENTS[:-1])}")
    check_ranges(cfg, RANGES)
    validate_synthetic(cfg.dataset.synthetic)  # dataset.synthetic.*, before any work (also checked when generating)
    opt = cfg.optimizer
    if opt.dense_kernel == "fused" and opt.name != "adagrad":
        raise UserError(f"optimizer.dense_kernel=fused is Adagrad's (optimizer.name={opt.name}: its update "
                        "is one pass already)")
    if opt.decay_start_step is not None and opt.decay_start_step < opt.warmup_steps:
        raise UserError(f"optimizer.decay_start_step={opt.decay_start_step} is inside the warmup "
                        f"(optimizer.warmup_steps={opt.warmup_steps}): the decay starts after the warmup ends")
    if cfg.model.interaction == "dot" and cfg.model.bottom_mlp[-1] != cfg.model.embedding_dim:
        raise UserError(
            f"model.bottom_mlp ends in {cfg.model.bottom_mlp[-1]} but the dot interaction needs "
            f"model.embedding_dim={cfg.model.embedding_dim}"
        )
    if not cfg.trainer.drop_last and cfg.trainer.nproc > 1:
        raise UserError(DROP_LAST_RANKS)
    if cfg.placement.sharding != "replicated":
        if cfg.placement.kind == "auto":
            raise UserError(f"placement.sharding={cfg.placement.sharding} places each shard by placement.kind; "
                            "placement.kind=auto (the budget search over whole tables) does not shard: pick a kind")
        if cfg.trainer.embedding_sync == "cache_avg":
            raise UserError(f"placement.sharding={cfg.placement.sharding} gives each row one owner: there are no "
                            "replicas for trainer.embedding_sync=cache_avg to average; use embedding_sync=grad")
    if cfg.model.top_mlp[-1] != 1:
        raise UserError(f"model.top_mlp must end in 1 (one logit), got {list(cfg.model.top_mlp)}")
    check_precision_cache_ratio(cfg)
    if cfg.trainer.embedding_sync == "cache_avg":  # before any rank starts (the ranks found it after theirs began)
        if cfg.precision.kind != "fp32":
            raise UserError(cache_avg_low_precision(cfg.precision.kind))
        if not {cfg.placement.kind, *cfg.placement.overrides.values()} & set(CACHED_PLACEMENTS):
            raise UserError(cache_avg_without_cache(cfg.placement.kind))


# Options that the rest of the config makes meaningless are said in a note
# each at start-up (the trainer prints them, rank 0 alone), not refused: a
# resumed run re-applies its saved overrides (train/resume_overrides.py) and
# may legitimately change placement.kind or trainer.nproc
# (docs/how-to/checkpoints.md), which leaves some of them without use; a note
# keeps that resume going and still tells a user who set one by hand that it
# did nothing. A rule speaks only when the option is set away from the
# schema's default and surely has no effect; where the tables' placements are
# known only later (placement=auto's search) it says nothing.
CACHED_KINDS = ("lookahead", "cache", "disk")  # placements with a placement cache (placement.cache_rows ...)


def no_effect_notes(cfg: Any, processes: int | None = None) -> list[str]:
    """One line per option of `cfg` set away from its default that has no
    effect with the rest of the config, e.g. `note: placement.cache_rows=1000
    has no effect with placement=device (only cache, lookahead and disk use
    it)`. `processes`: the processes that train (default: trainer.nproc; under
    torchrun the group's size)."""
    pl, pr, opt, tc, model, data = cfg.placement, cfg.precision, cfg.optimizer, cfg.trainer, cfg.model, cfg.dataset
    procs = int(tc.nproc if processes is None else processes)
    auto = pl.kind == "auto"
    kinds = {"device" if pl.kind == "gpu" else str(pl.kind)}  # the placements a table can get
    if not auto:  # auto: the search places every table (overrides and device_max_rows aside)
        kinds |= {"device" if k == "gpu" else str(k) for k in pl.overrides.values()}
        if pl.device_max_rows is not None:
            kinds.add("device")
    placed = f"placement={pl.kind}" + (" and its overrides" if pl.overrides and not auto else "")
    one = "one process" + (" (trainer.nproc=1)" if tc.nproc == 1 else "")
    no_cache = ("with placement=auto (its search sizes every cache)" if auto else
                f"with {placed} (only cache, lookahead and disk use it)" if not kinds & set(CACHED_KINDS) else None)
    on_disk = "disk" in kinds or (auto and bool(pl.host_memory_budget))
    no_disk = None if on_disk else (
        "with placement=auto without placement.host_memory_budget (only then it puts tables on disk)" if auto
        else f"with {placed} (only disk uses it)")
    try:
        path = data.path
    except Exception:  # a mandatory path left unset: training_data says so
        path = None
    syn = data.synthetic
    # (key, why it has no effect or None); a key's first reason that applies is said
    rules: list[tuple[str, Optional[str]]] = [
        ("placement.cache_rows", no_cache),
        ("placement.cache_ratio", no_cache),
        ("placement.cache_ratio", None if pl.cache_rows is None else
         f"with placement.cache_rows={pl.cache_rows} (cache_rows sizes the cache)"),
        ("placement.window", None if kinds & {"lookahead", "disk", "auto"} else
         f"with {placed} (only lookahead and disk prefetch batches ahead)"),
        ("placement.policy", None if kinds & {*CACHED_KINDS, "auto"} else
         f"with {placed} (only cache, lookahead and disk have a placement cache; a low-precision table's "
         "own cache follows precision.policy)"),
        ("placement.device_max_rows", "with placement=auto (its search places every table)" if auto else
         f"with placement={pl.kind} (every table is on the device already)" if pl.kind in ("device", "gpu") else None),
        ("placement.device_memory_budget", None if auto or (pl.sharding != "replicated" and procs > 1) else
         f"with placement={pl.kind} (only placement=auto, and placement.sharding over several processes, use it)"),
        ("placement.host_memory_budget", None if auto else f"with placement={pl.kind} (only placement=auto uses it)"),
        ("placement.disk_path", no_disk),
        ("placement.host_cache_rows", no_disk),
        ("placement.host_cache_ratio", no_disk),
        ("placement.host_cache_ratio", None if auto or pl.host_cache_rows is None else
         f"with placement.host_cache_rows={pl.host_cache_rows} (host_cache_rows sizes the host cache)"),
        ("placement.disk_io_threads", no_disk),
        ("placement.sharding", f"with {one}: it holds every table" if procs == 1 else None),
        ("precision.rounding", "with precision=fp32 (only fp16, int8 and int4 rows are rounded)"
         if pr.kind == "fp32" else None),
        ("precision.policy", "with precision=fp32 (it is the policy of a low-precision table's own cache)"
         if pr.kind == "fp32" else None),
        ("precision.policy", None if kinds - {*CACHED_KINDS, "auto"} else
         f"with {placed} (every table is behind a placement cache, which follows placement.policy)"),
        *((f"optimizer.{key}", f"with optimizer.name={opt.name} (only adagrad uses it)" if opt.name != "adagrad"
           else None) for key in ("eps", "initial_accumulator")),
        *((f"optimizer.{key}", f"with optimizer.schedule={opt.schedule} (only warmup_poly uses it)"
           if opt.schedule == "constant" else None)
          for key in ("warmup_steps", "decay_start_step", "decay_steps", "decay_power", "min_lr")),
        ("model.dcn_layers", None if model.interaction == "dcn" else
         f"with model.interaction={model.interaction} (only dcn uses it)"),
        ("model.dcn_rank", None if model.interaction == "dcn" else
         f"with model.interaction={model.interaction} (only dcn uses it)"),
        ("trainer.embedding_sync", f"with {one}: there are no replicas to keep in step" if procs == 1 else None),
        ("trainer.sync_every", f"with {one}: there are no replicas to average" if procs == 1 else
         None if tc.embedding_sync == "cache_avg" else
         f"with trainer.embedding_sync={tc.embedding_sync} (only cache_avg uses it)"),
        ("trainer.dist_timeout", f"with {one}: there are no peers to wait for" if procs == 1 else None),
        ("trainer.oversubscribe", f"with {one}" if procs == 1 else None),
        ("trainer.early_stop_min_delta", None if tc.early_stop_patience is not None else
         "without trainer.early_stop_patience (only early stopping uses it)"),
        ("dataset.cache_dir", None if not path else
         "with dataset.path set (only the built-in synthetic data is generated there)"),
        *((f"dataset.synthetic.{f.name}", "with dataset.path set (it describes the built-in synthetic data)"
           if path else None) for f in dataclasses.fields(SyntheticConfig)),
        *((f"dataset.synthetic.{key}", None if syn.sessions else "with dataset.synthetic.sessions=false")
          for key in ("session_mean_length", "session_repeat")),
        *((f"dataset.synthetic.{key}", None if syn.multi_hot_features else
           "with dataset.synthetic.multi_hot_features=0") for key in
          ("multi_hot_vocab", "multi_hot_max_length", "multi_hot_min_length")),
        ("dataset.synthetic.profile", None if syn.cardinalities is None else
         "with dataset.synthetic.cardinalities set (they replace the profile's)"),
    ]
    if auto:  # a table's own placement: the search places every table
        rules += [(f"placement.overrides.{name}", "with placement=auto (its search places every table)")
                  for name in pl.overrides]
    notes, said = [], set()
    for key, why in rules:
        if why is None or key in said:
            continue
        value = _plain(_get(cfg, key))
        if key.startswith("placement.overrides.") or value != _plain(_get(_DEFAULTS, key)):
            said.add(key)
            notes.append(f"note: {key}={_shown(value)} has no effect {why}")
    return notes


_DEFAULTS = TrainConfig()


def _plain(value: Any) -> Any:
    """A config value as plain Python (OmegaConf's lists as lists), to compare with the schema's default."""
    if isinstance(value, (str, bytes)) or value is None:
        return value
    if hasattr(value, "__len__") and hasattr(value, "__iter__") and not hasattr(value, "keys"):
        return [_plain(v) for v in value]
    return value


def _shown(value: Any) -> str:
    """`value` as an override writes it (true, null, [1,2])."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return "null" if value is None else str(value)


def cache_avg_without_cache(placement_kind: str) -> str:
    return (f"trainer.embedding_sync=cache_avg averages cache rows, but placement.kind={placement_kind} "
            "puts no table behind a cache: use placement=lookahead (or cache), or trainer.embedding_sync=grad")


def cache_avg_low_precision(precision_kind: str) -> str:
    return (f"trainer.embedding_sync=cache_avg needs fp32 tables behind the cache, not precision.kind="
            f"{precision_kind}: use trainer.embedding_sync=grad")


# Placements that put a table behind a cache of their own, sized by
# placement.cache_ratio / cache_rows (auto: by the budget).
CACHED_PLACEMENTS = ("lookahead", "cache", "disk", "auto")


def check_precision_cache_ratio(cfg: Any, kinds: set[str] | None = None) -> None:
    """precision.cache_ratio sizes the on-demand fp32 cache in front of a
    low-precision table whose placement has no cache (device, host, uvm); a
    placement with a cache sizes it itself. A precision.cache_ratio that no
    table would use is refused, never silently replaced: with
    placement=lookahead precision=int4 precision.cache_ratio=0.01 the run
    trained with a 5 % cache without a word (issue 40). `kinds`: the
    placements the tables really get (default: every placement the config
    can give a table)."""
    ratio = cfg.precision.cache_ratio
    if ratio is None:
        return
    if cfg.precision.kind == "fp32":
        raise UserError(f"precision.cache_ratio={ratio:g} sizes the fp32 cache in front of fp16/int8/int4 tables; "
                        "fp32 tables (precision.kind=fp32) have none: remove it, or set precision.kind")
    if kinds is None:
        kinds = {cfg.placement.kind, *cfg.placement.overrides.values()}
        if cfg.placement.device_max_rows is not None:
            kinds.add("device")
    if any(k not in CACHED_PLACEMENTS for k in kinds):
        return  # some table sits behind a cache of this ratio
    kind = cfg.placement.kind
    if kind == "auto":
        sizes = "placement=auto sizes every cache from placement.device_memory_budget"
    else:
        sizes = (f"placement={kind} puts every table behind its own fp32 cache, sized by "
                 f"placement.cache_ratio={cfg.placement.cache_ratio:g}" +
                 (f" (placement.cache_rows={cfg.placement.cache_rows})" if cfg.placement.cache_rows else "") +
                 f": for a cache of {ratio:g} of the rows give placement.cache_ratio={ratio:g}")
    raise UserError(f"precision.cache_ratio={ratio:g} would not be used: {sizes} (precision.cache_ratio sizes "
                    "the cache of a low-precision table placed on device, host or uvm)")


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
