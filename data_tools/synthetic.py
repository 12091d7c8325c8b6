"""Synthetic Criteo-like data: the built-in dataset and a test/benchmark input.

(Over 450 lines on purpose: one generative model. The world's parameters,
the chunked sampling and the two writers of the same rows, parquet shards
and raw TSV, share the world's private arrays, and the TSV writer must emit
exactly the rows `generate` does; the output directory's handling lives in
dataset_dir.py, the shard format in shards.py.)

What is generated (all vectorised numpy, chunk by chunk, deterministic from
`seed`: the same config gives byte-identical shards):

* 13 dense features as raw integers (heavy tailed, some negative, missing at a
  Criteo-like per-feature rate); shards hold log(1 + max(x, 0)), missing -> 0.
* 26 one-hot sparse features C1..C26 whose vocabulary sizes follow the Criteo
  Kaggle profile scaled by `cardinality_scale`:
  vocab_f = min(card_f, max(min_vocab, ceil(card_f * cardinality_scale))), and
  ceil(card_f * cardinality_scale) for a scale above 1 (larger than Kaggle).
  Id 0 means missing; present values are Zipf(`zipf_exponent`)-distributed
  ranks over 1..vocab_f-1, scattered over the id range by a fixed random
  permutation (the hottest id is not id 1).
* Optional sessions (`sessions=true`): geometric session lengths with mean
  `session_mean_length`; within a session each sparse value equals the
  session's value with probability `session_repeat` (else it is drawn fresh);
  a `session` int64 column; splits keep sessions whole.
* Optional multi-hot features H1..Hk (list<int32>, ids in 1..multi_hot_vocab-1,
  lengths uniform in [multi_hot_min_length, multi_hot_max_length]); with
  sessions, one bag per session shared by its samples.
* Labels from a hidden model: per-id random effects, a low-rank pairwise
  interaction of per-id vectors (what DLRM's dot interaction can express), a
  linear term in the dense features and a multi-hot bag term, through a
  sigmoid whose intercept is calibrated to a click rate of about 25 %. The
  true click probability reaches a validation AUC of about 0.8; `generate`
  records it in the manifest (options.hidden_model).

Missing rates: `missing_rate` is the mean missing rate over the 39 features;
per-feature rates follow the Criteo Kaggle profile (some features never
missing, a few mostly missing), scaled to that mean and clipped at 0.95.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa

from data_tools import dataset_dir
from data_tools import shards as sh
from data_tools.criteo_text import dense_log1p
from data_tools.errors import UserError
from data_tools.manifest import (
    CRITEO_DENSE,
    CRITEO_SPARSE,
    NUM_DENSE,
    SPLITS,
    Manifest,
    SparseFeature,
    load_manifest,
)
from data_tools.metrics import roc_auc

# part of the cache key: bump when the output changes (3: scales above 1 uncapped; 4: dense log1p in float64)
GENERATOR_VERSION = 4

# Criteo Kaggle distinct values per categorical feature (DLRM's counts).
KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
# Criteo Terabyte (1TB) rows per categorical feature as MLPerf DLRM-DCNv2 trains
# them: each feature's distinct values capped at 40M rows (the reference's
# --num_embeddings_per_feature; TorchRec's dlrm example, DEFAULT_CAT_NAMES order
# C1..C26), about 204M rows. profile=terabyte; configs/dataset/synthetic_mlperf.yaml.
TERABYTE_CARDINALITIES = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]
MLPERF_CARDINALITIES = TERABYTE_CARDINALITIES  # the same tables, by the benchmark's name
PROFILES = {"kaggle": KAGGLE_CARDINALITIES, "terabyte": TERABYTE_CARDINALITIES}
# Approximate fraction of missing values per feature in Criteo Kaggle.
_DENSE_MISSING_PROFILE = [
    0.454, 0.0, 0.215, 0.217, 0.026, 0.224, 0.043, 0.0005, 0.043, 0.454, 0.043, 0.765, 0.217,
]
_SPARSE_MISSING_PROFILE = [
    0.0, 0.0, 0.034, 0.034, 0.0, 0.121, 0.0, 0.0, 0.0, 0.0, 0.0, 0.034, 0.0,
    0.0, 0.0, 0.034, 0.0, 0.0, 0.44, 0.44, 0.034, 0.763, 0.0, 0.034, 0.44, 0.44,
]
# Typical log1p magnitude per dense feature (std of the half-normal in log space).
_DENSE_LOG_SCALE = [1.2, 2.5, 2.0, 1.6, 5.0, 2.7, 1.8, 1.9, 2.8, 0.6, 1.2, 0.9, 1.6]

_CHUNK_ROWS = 1 << 18  # generation chunk; fixed so output does not depend on it
_INTERACTION_DIM = 4
_INTERACTION_TABLE = 1 << 16
_PILOT_ROWS = 1 << 15
_TARGET_CTR = 0.25
_AUC_SAMPLE_ROWS = 1_000_000


@dataclass
class SyntheticConfig:
    # Rows in all splits together. The default (500k rows at cardinality
    # scale 0.002) is `recsys train`'s built-in dataset, and what `recsys
    # preprocess synthetic` writes unless told otherwise.
    rows: int = 500_000
    seed: int = 0  # the data is a function of the options and this seed
    # Vocabulary of feature f: min(card_f, max(min_vocab, ceil(card_f * scale))),
    # card_f the profile's distinct values of the feature.
    cardinality_scale: float = 0.002
    # kaggle (Criteo Kaggle's distinct values per feature) | terabyte (Criteo
    # 1TB's, capped at 40M as MLPerf DLRM-DCNv2 trains them; with
    # cardinality_scale=1, 26 tables of about 204M rows in all)
    profile: str = "kaggle"
    # Any other profile: distinct values (ids, with id 0 = missing) of C1..C26,
    # in place of the named profile's. At cardinality_scale 1.0 the tables have
    # exactly these rows.
    cardinalities: Optional[list[int]] = None
    min_vocab: int = 3  # the smallest vocabulary of a feature
    zipf_exponent: float = 1.1  # the skew of the ids' Zipf draws
    missing_rate: float = 0.05  # mean over the 39 features; Criteo-like per-feature profile
    split_ratios: list[float] = field(default_factory=lambda: [0.8, 0.1, 0.1])  # train, val, test
    row_group_rows: int = 65536  # rows per parquet row group
    sessions: bool = False  # rows in sessions of one user (a session column; RecD's dedup finds repeats)
    session_mean_length: float = 8.0  # sessions: mean rows per session
    session_repeat: float = 0.85  # sessions: chance a sparse value equals its session's (else drawn fresh)
    multi_hot_features: int = 0  # extra multi-hot (bag) features, e.g. a user's history
    multi_hot_vocab: int = 100_000  # multi-hot features: vocabulary of each
    multi_hot_max_length: int = 50  # multi-hot features: the longest bag
    multi_hot_min_length: int = 0  # multi-hot features: the shortest bag


# --------------------------------------------------------------------------- config helpers


def _coerce(cfg) -> SyntheticConfig:
    """Accept a SyntheticConfig, an OmegaConf node or a dict with its fields."""
    if isinstance(cfg, SyntheticConfig):
        return cfg
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    names = {f.name for f in dataclasses.fields(SyntheticConfig)}
    return SyntheticConfig(**{k: v for k, v in dict(cfg).items() if k in names})


def validate(cfg: SyntheticConfig) -> None:
    def bad(msg: str) -> None:
        raise UserError(f"synthetic config: {msg}")

    for name in ("cardinality_scale", "zipf_exponent", "missing_rate", "session_mean_length", "session_repeat"):
        if not math.isfinite(getattr(cfg, name)):
            bad(f"{name} must be a finite number, got {getattr(cfg, name)}")
    if cfg.rows < 1:
        bad(f"rows must be >= 1, got {cfg.rows}")
    if cfg.seed < 0:  # numpy's generators take non-negative seeds
        bad(f"seed must be >= 0, got {cfg.seed}")
    if not cfg.cardinality_scale > 0:
        bad(f"cardinality_scale must be > 0, got {cfg.cardinality_scale}")
    if cfg.profile not in PROFILES:
        bad(f"profile must be one of {', '.join(PROFILES)}, got {cfg.profile!r}")
    if cfg.cardinalities is not None:
        cards = list(cfg.cardinalities)
        if len(cards) != len(CRITEO_SPARSE) or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1
                                                       for c in cards):
            bad(f"cardinalities must be {len(CRITEO_SPARSE)} integers >= 1 (C1..C26), got {cards}")
    if max(profile(cfg)) * cfg.cardinality_scale >= 2**31:  # ids are int32 in the generator
        bad(f"cardinality_scale {cfg.cardinality_scale} makes a feature's vocabulary exceed 2**31 ids")
    if cfg.min_vocab < 2:
        bad(f"min_vocab must be >= 2 (id 0 is reserved for missing), got {cfg.min_vocab}")
    if not cfg.zipf_exponent > 0:
        bad(f"zipf_exponent must be > 0, got {cfg.zipf_exponent}")
    if not 0 <= cfg.missing_rate < 1:
        bad(f"missing_rate must be in [0, 1), got {cfg.missing_rate}")
    if cfg.row_group_rows < 1:
        bad(f"row_group_rows must be >= 1, got {cfg.row_group_rows}")
    if not cfg.session_mean_length >= 1:
        bad(f"session_mean_length must be >= 1, got {cfg.session_mean_length}")
    if not 0 <= cfg.session_repeat <= 1:
        bad(f"session_repeat must be in [0, 1], got {cfg.session_repeat}")
    if cfg.multi_hot_features < 0:
        bad(f"multi_hot_features must be >= 0, got {cfg.multi_hot_features}")
    if cfg.multi_hot_vocab < 2:
        bad(f"multi_hot_vocab must be >= 2, got {cfg.multi_hot_vocab}")
    if not 0 <= cfg.multi_hot_min_length <= cfg.multi_hot_max_length:
        bad(
            "need 0 <= multi_hot_min_length <= multi_hot_max_length, got "
            f"{cfg.multi_hot_min_length} and {cfg.multi_hot_max_length}"
        )
    ratios = list(cfg.split_ratios)
    if len(ratios) != 3 or not all(math.isfinite(r) and r >= 0 for r in ratios) or sum(ratios) <= 0:
        bad(f"split_ratios must be three finite non-negative numbers (train, val, test), got {ratios}")


def profile(cfg: SyntheticConfig) -> list[int]:
    """The distinct values per feature that cardinality_scale scales."""
    return list(cfg.cardinalities) if cfg.cardinalities is not None else PROFILES[cfg.profile]


def vocab_sizes(cfg: SyntheticConfig) -> list[int]:
    """Vocabulary size (including id 0 = missing) of C1..C26. Above 1 the
    profile grows past its own (as Criteo Terabyte's hashing to tens of
    millions of rows a feature would): tables larger than host memory."""
    cards = profile(cfg)
    if cfg.cardinality_scale > 1:
        return [math.ceil(c * cfg.cardinality_scale) for c in cards]
    return [int(min(c, max(cfg.min_vocab, math.ceil(c * cfg.cardinality_scale)))) for c in cards]


def missing_rates(cfg: SyntheticConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature missing rates (dense [13], sparse [26]) with mean missing_rate."""
    profile = np.array(_DENSE_MISSING_PROFILE + _SPARSE_MISSING_PROFILE)
    rates = np.clip(profile * (cfg.missing_rate / profile.mean()), 0.0, 0.95)
    return rates[:NUM_DENSE], rates[NUM_DENSE:]


def config_hash(cfg: SyntheticConfig) -> str:
    fields = dataclasses.asdict(cfg)
    # the Kaggle profile: the key of every dataset cached before profiles and cardinalities existed
    if fields["cardinalities"] is None:
        del fields["cardinalities"]
    if fields["profile"] == "kaggle":
        del fields["profile"]
    payload = json.dumps({"generator": GENERATOR_VERSION, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- the hidden model


class _World:
    """Everything fixed by the config: vocabularies, permutations, the hidden model."""

    def __init__(self, cfg: SyntheticConfig):
        self.cfg = cfg
        self.vocab = vocab_sizes(cfg)
        self.dense_missing, self.sparse_missing = missing_rates(cfg)
        self.multi_names = [f"H{i}" for i in range(1, cfg.multi_hot_features + 1)]
        root = np.random.SeedSequence([cfg.seed, 0x5E7])
        rng = np.random.default_rng(root)
        nf = len(self.vocab)
        # Scatter Zipf ranks over 1..V-1.
        self.perm = [
            (rng.permutation(v - 1).astype(np.int32) + 1) for v in self.vocab
        ]
        # Per-feature importance of the random effects and per-id effects (id 0: none).
        self.sparse_weight = rng.uniform(0.15, 0.45, nf) * np.sqrt(26.0 / nf)
        self.effects = []
        self.inter = []
        for v in self.vocab:
            e = rng.standard_normal(v).astype(np.float32)
            e[0] = 0.0
            self.effects.append(e)
            t = min(v, _INTERACTION_TABLE)
            iv = (rng.standard_normal((t, _INTERACTION_DIM)) / math.sqrt(_INTERACTION_DIM)).astype(np.float32)
            iv[0] = 0.0
            self.inter.append(iv)
        self.inter_weight = 0.11
        self.dense_scale = np.array(_DENSE_LOG_SCALE)
        self.dense_beta = rng.normal(0.0, 0.25, NUM_DENSE)
        # Multi-hot: per-id effects, mean over the bag.
        self.mh_effects = [
            rng.standard_normal(cfg.multi_hot_vocab).astype(np.float32) for _ in self.multi_names
        ]
        self.mh_weight = 0.5
        self.intercept = 0.0
        self.intercept = self._calibrate()

    # -- sampling helpers
    def zipf_ids(self, rng: np.random.Generator, f: int, n: int) -> np.ndarray:
        """n present ids of feature f (in 1..V-1), Zipf over ranks, permuted."""
        m = self.vocab[f] - 1
        return self.perm[f][_zipf_ranks(rng, m, self.cfg.zipf_exponent, n)]

    def logit(self, ids: list[np.ndarray], dense: np.ndarray, bags: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        n = dense.shape[0]
        z = np.full(n, self.intercept, dtype=np.float64)
        vsum = np.zeros((n, _INTERACTION_DIM), dtype=np.float32)
        sq = np.zeros(n, dtype=np.float32)
        for f, x in enumerate(ids):
            z += self.sparse_weight[f] * self.effects[f][x]
            t = self.inter[f].shape[0]
            v = self.inter[f][x % t if t < self.vocab[f] else x]
            vsum += v
            sq += np.einsum("ij,ij->i", v, v)
        z += self.inter_weight * 0.5 * (np.einsum("ij,ij->i", vsum, vsum) - sq)
        # Dense: standardised log1p values (missing -> 0, like the shards).
        center = self.dense_scale * 0.8
        z += ((dense - center) / self.dense_scale) @ self.dense_beta
        for k, (offsets, values) in enumerate(bags):
            lengths = np.diff(offsets)
            total = np.zeros(n, dtype=np.float64)
            if values.size:
                eff = self.mh_effects[k][values].astype(np.float64)
                csum = np.concatenate([[0.0], np.cumsum(eff)])
                total = csum[offsets[1:]] - csum[offsets[:-1]]
            z += self.mh_weight * total / np.sqrt(np.maximum(lengths, 1))
        return z

    def _calibrate(self) -> float:
        """Intercept giving a mean click probability of _TARGET_CTR on a pilot sample."""
        rng = np.random.default_rng(np.random.SeedSequence([self.cfg.seed, 0xCA11]))
        chunk = _sample_chunk(self, rng, _PILOT_ROWS, session_start=0, labels=False)
        z = chunk["logit"]
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if _sigmoid(z + mid).mean() > _TARGET_CTR:
                hi = mid
            else:
                lo = mid
        return 0.5 * (lo + hi)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _zipf_ranks(rng: np.random.Generator, m: int, s: float, n: int) -> np.ndarray:
    """n ranks in [0, m) with P(rank r) ~ (r + 1)^-s (inverse CDF of the
    continuous power law on [1, m + 1), floored)."""
    if m <= 1:
        return np.zeros(n, dtype=np.int64)
    u = rng.random(n)
    if abs(s - 1.0) < 1e-9:
        x = np.power(m + 1.0, u)
    else:
        a = 1.0 - s
        x = np.power(1.0 - u * (1.0 - np.power(m + 1.0, a)), 1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, m - 1).clip(0)


def _dense_raw(world: _World, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw integer dense values [n, 13] (int64) and their missing mask."""
    z = np.abs(rng.standard_normal((n, NUM_DENSE))) * world.dense_scale
    raw = np.floor(np.expm1(z)).astype(np.int64)
    # I2 in Criteo has small negative values now and then.
    neg = rng.random(n) < 0.05
    raw[neg, 1] = -rng.integers(1, 4, int(neg.sum()))
    missing = rng.random((n, NUM_DENSE)) < world.dense_missing
    return raw, missing


def _bags(world: _World, rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    cfg = world.cfg
    out = []
    for _ in world.multi_names:
        lengths = rng.integers(cfg.multi_hot_min_length, cfg.multi_hot_max_length + 1, n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = 1 + _zipf_ranks(rng, cfg.multi_hot_vocab - 1, cfg.zipf_exponent, int(offsets[-1]))
        out.append((offsets, values.astype(np.int32)))
    return out


def _expand_bags(bags, session_of_row: np.ndarray):
    """Per-session bags -> per-row bags (row i gets its session's bag)."""
    out = []
    for offsets, values in bags:
        lengths = np.diff(offsets)[session_of_row]
        new_off = np.zeros(len(session_of_row) + 1, dtype=np.int64)
        np.cumsum(lengths, out=new_off[1:])
        starts = offsets[:-1][session_of_row]
        idx = np.repeat(starts - new_off[:-1], lengths) + np.arange(int(new_off[-1]))
        out.append((new_off, values[idx]))
    return out


def _sample_chunk(world: _World, rng: np.random.Generator, n: int, session_start: int, labels: bool = True) -> dict:
    cfg = world.cfg
    nf = len(world.vocab)
    if cfg.sessions:
        p = 1.0 / cfg.session_mean_length
        lengths: list[np.ndarray] = []
        total = 0
        while total < n:
            more = rng.geometric(p, max(16, int((n - total) * p * 1.2) + 16))
            lengths.append(more)
            total += int(more.sum())
        lens = np.concatenate(lengths)
        ends = np.cumsum(lens)
        ns = int(np.searchsorted(ends, n, side="left")) + 1
        lens = lens[:ns].copy()
        lens[-1] -= int(ends[ns - 1] - n)  # truncate the last session at the chunk end
        session_of_row = np.repeat(np.arange(ns), lens)
        session = session_start + session_of_row
        first = np.zeros(n, dtype=bool)
        first[np.concatenate([[0], np.cumsum(lens)[:-1]])] = True
    else:
        ns = n
        session_of_row = None
        session = None
        first = None
    ids: list[np.ndarray] = []
    for f in range(nf):
        # Fresh draws for every row (and session values when in session mode).
        fresh = world.zipf_ids(rng, f, n)
        fresh[rng.random(n) < world.sparse_missing[f]] = 0
        if cfg.sessions:
            sval = world.zipf_ids(rng, f, ns)
            sval[rng.random(ns) < world.sparse_missing[f]] = 0
            repeat = rng.random(n) < cfg.session_repeat
            fresh = np.where(repeat, sval[session_of_row], fresh)
        ids.append(fresh.astype(np.int32))
    raw, dmissing = _dense_raw(world, rng, n)
    dense = dense_log1p(raw)  # what preprocessing computes from the same integers
    dense[dmissing] = 0.0
    bags = _bags(world, rng, ns)
    if session_of_row is not None and bags:  # session mode
        bags = _expand_bags(bags, session_of_row)
    z = world.logit(ids, dense, bags)
    out = {
        "ids": ids,
        "raw": raw,
        "dense_missing": dmissing,
        "dense": dense,
        "bags": bags,
        "session": session,
        "sessions_in_chunk": ns,
        "first_in_session": first,
        "logit": z,
    }
    if labels:
        prob = _sigmoid(z)
        out["prob"] = prob
        out["label"] = (rng.random(n) < prob).astype(np.float32)
    return out


def _chunks(world: _World) -> Iterator[tuple[int, dict]]:
    """(first global row, chunk) for every generation chunk, in order."""
    cfg = world.cfg
    session_start = 0
    for c, start in enumerate(range(0, cfg.rows, _CHUNK_ROWS)):
        n = min(_CHUNK_ROWS, cfg.rows - start)
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 1, c]))
        chunk = _sample_chunk(world, rng, n, session_start)
        session_start += chunk["sessions_in_chunk"]
        yield start, chunk


def _split_runs(cfg: SyntheticConfig, start: int, chunk: dict) -> list[tuple[str, int, int]]:
    """(split, lo, hi) row slices of a chunk. A row goes to the split that
    holds the first row of its session, so sessions stay whole."""
    n = len(chunk["label"])
    ranges = sh.ratio_ranges(cfg.rows, cfg.split_ratios)
    cuts = np.array([ranges[0][2], ranges[1][2]])
    if chunk["session"] is not None:
        first = chunk["first_in_session"]
        row_index = start + np.arange(n)
        # Every chunk starts a session (the last one of a chunk is cut at its end).
        session_first_row = np.maximum.accumulate(np.where(first, row_index, -1))
        which = np.searchsorted(cuts, session_first_row, side="right")
    else:
        which = np.searchsorted(cuts, start + np.arange(n), side="right")
    runs = []
    for k, split in enumerate(SPLITS):
        idx = np.flatnonzero(which == k)
        if idx.size:
            runs.append((split, int(idx[0]), int(idx[-1]) + 1))
    return runs


# --------------------------------------------------------------------------- parquet


def _features(world: _World) -> list[SparseFeature]:
    feats = [SparseFeature(name, v) for name, v in zip(CRITEO_SPARSE, world.vocab)]
    feats += [SparseFeature(name, world.cfg.multi_hot_vocab, multi_hot=True) for name in world.multi_names]
    return feats


def generate(cfg: SyntheticConfig, output: Path, *, progress: bool = False) -> Manifest:
    """Write the synthetic dataset (shards + manifest) to `output`, atomically.
    An existing dataset at `output` is replaced."""
    return _generate(_coerce(cfg), Path(output), if_exists="replace", progress=progress)


def _generate(cfg: SyntheticConfig, output: Path, if_exists: str, progress: bool = False) -> Manifest:
    validate(cfg)
    world = _World(cfg)
    feats = _features(world)
    schema = sh.shard_schema(feats, session=cfg.sessions)
    val_p: list[np.ndarray] = []
    val_y: list[np.ndarray] = []
    val_rows = 0
    clicks = 0.0
    with dataset_dir.atomic_dataset_dir(output, if_exists=if_exists) as tmp, _progress(progress, cfg.rows, "generating") as bar:
        writer = sh.SplitWriter(
            tmp, schema, None, row_group_rows=cfg.row_group_rows,
            session_column="session" if cfg.sessions else None,
        )
        try:
            for start, chunk in _chunks(world):
                sparse: dict[str, np.ndarray | pa.Array] = dict(zip(CRITEO_SPARSE, chunk["ids"]))
                for name, (offsets, values) in zip(world.multi_names, chunk["bags"]):
                    sparse[name] = sh.multi_hot_array(offsets, values)
                table = sh.make_table(schema, chunk["label"], chunk["dense"], sparse, chunk["session"])
                for split, lo, hi in _split_runs(cfg, start, chunk):
                    writer.write_split(split, table.slice(lo, hi - lo))
                    if split == "val" and val_rows < _AUC_SAMPLE_ROWS:
                        val_p.append(chunk["prob"][lo:hi])
                        val_y.append(chunk["label"][lo:hi])
                        val_rows += hi - lo
                clicks += float(chunk["label"].sum())
                bar(len(chunk["label"]))
            splits = writer.close()
        except BaseException:
            writer.abort()
            raise
        hidden = {"click_rate": clicks / cfg.rows}
        if val_p:
            hidden["val_auc"] = roc_auc(np.concatenate(val_p), np.concatenate(val_y))
            hidden["val_auc_rows"] = min(val_rows, sum(len(p) for p in val_p))
        options = {**dataclasses.asdict(cfg), "generator_version": GENERATOR_VERSION, "hidden_model": hidden}
        manifest = Manifest(
            source="synthetic",
            sparse_features=feats,
            splits=splits,
            dense_features=list(CRITEO_DENSE),
            session_column="session" if cfg.sessions else None,
            options=options,
            inputs=[],
            skipped_lines=0,
        )
        manifest.save(tmp)
    return manifest


class _progress:
    """A rich progress bar, or nothing (not a TTY / progress off)."""

    def __init__(self, enabled: bool, total: int, what: str):
        self.enabled = enabled
        self.total = total
        self.what = what
        self._p = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(stderr=True)
            if console.is_terminal:
                self._p = Progress(
                    TextColumn(self.what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
                )
                self._p.start()
                self._task = self._p.add_task(self.what, total=self.total)

        def advance(n: int) -> None:
            if self._p is not None:
                self._p.advance(self._task, n)

        return advance

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.stop()
        return False


# --------------------------------------------------------------------------- raw TSV


def hex_values(f: int, ids: np.ndarray, seed: int) -> np.ndarray:
    """uint32 'hash' written for id `ids` of feature f: a bijection of the id
    (murmur3's fmix32 of id xor a per-feature salt), so distinct ids give
    distinct hex strings."""
    salt = np.uint32((0x9E3779B1 * (f + 1) + 0x7F4A7C15 * (seed + 1)) & 0xFFFFFFFF)
    h = ids.astype(np.uint32) ^ salt
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _hex_column(values: np.ndarray, present: np.ndarray) -> pa.Array:
    """uint32 values -> string array of 8 lowercase hex digits, null where absent."""
    v = values[present].astype(np.uint32)
    shifts = np.arange(28, -1, -4, dtype=np.uint32)
    digits = _HEX[(v[:, None] >> shifts) & np.uint32(15)]
    n = len(values)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(present.astype(np.int32) * 8, out=offsets[1:])
    validity = pa.array(present).buffers()[1]
    return pa.Array.from_buffers(
        pa.string(), n, [validity, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(digits))],
        null_count=int(n - present.sum()),
    )


def tsv_table(world: _World, chunk: dict) -> pa.Table:
    cols = {"label": pa.array(chunk["label"].astype(np.int8))}
    raw, dmissing = chunk["raw"], chunk["dense_missing"]
    for j, name in enumerate(CRITEO_DENSE):
        cols[name] = pa.array(raw[:, j], mask=dmissing[:, j])
    for f, name in enumerate(CRITEO_SPARSE):
        ids = chunk["ids"][f]
        cols[name] = _hex_column(hex_values(f, ids, world.cfg.seed), ids != 0)
    return pa.table(cols)


def _tsv_output(path: str | os.PathLike) -> Path:
    path = Path(path).expanduser().absolute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {path.parent}: {e.strerror or e}") from None
    return path


def _write_tsv_file(path: Path, tables: Iterator[pa.Table], advance) -> Path:
    """Write `tables` as raw Criteo TSV to `path` (gzip'd when it ends in
    .gz), through a temporary file renamed at the end."""
    import pyarrow.csv as pacsv

    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    opts = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none", batch_size=1 << 16)
    try:
        try:
            sink = pa.CompressedOutputStream(str(tmp), "gzip") if path.suffix == ".gz" else pa.OSFile(str(tmp), "wb")
        except OSError as e:
            raise UserError(f"output {path} is not writable: {e}") from None
        with sink:
            writer = None
            for table in tables:
                if writer is None:
                    writer = pacsv.CSVWriter(sink, table.schema, write_options=opts)
                writer.write_table(table)
                advance(table.num_rows)
            if writer is not None:
                writer.close()
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
    return path


def _tsv_world(cfg) -> _World:
    cfg = _coerce(cfg)
    validate(cfg)
    if cfg.multi_hot_features:
        raise UserError("the Criteo TSV format has no multi-hot features: set multi_hot_features=0 for format=tsv")
    return _World(cfg)


def write_tsv(cfg: SyntheticConfig, path: str | os.PathLike, *, progress: bool = False) -> Path:
    """Write the synthetic rows as raw Criteo TSV (label, I1..I13 integers,
    C1..C26 8-hex-digit strings, empty fields for missing values), gzip'd when
    the path ends in .gz. Same rows, labels and dense values as `generate`;
    sparse id k of feature f is written as hex_values(f, k). Multi-hot
    features cannot be written (the format has no place for them)."""
    world = _tsv_world(cfg)
    path = _tsv_output(path)
    if path.is_dir():
        raise UserError(f"output {path} is a directory; format=tsv writes one file (e.g. {path}/train.txt)")
    with _progress(progress, world.cfg.rows, "writing tsv") as bar:
        return _write_tsv_file(path, (tsv_table(world, chunk) for _, chunk in _chunks(world)), bar)


def day_rows(rows: int, days: int) -> list[tuple[int, int]]:
    """[start, end) global rows of each day: `rows` cut into `days` equal
    runs in order, the later days one row longer when it does not divide."""
    return [(d * rows // days, (d + 1) * rows // days) for d in range(days)]


def write_tsv_days(cfg: SyntheticConfig, directory: str | os.PathLike, days: int, *, gz: bool = False,
                   progress: bool = False) -> list[Path]:
    """The rows of `write_tsv` as Criteo Terabyte's day files:
    directory/day_0 .. day_<days-1> (day_N.gz with gz), the rows cut into
    `days` equal runs in order (day_rows), each file written through a
    temporary name. The concatenation of the day files is write_tsv's file."""
    world = _tsv_world(cfg)
    if days < 1:
        raise UserError(f"days must be >= 1, got {days}")
    if days > world.cfg.rows:
        raise UserError(f"days={days} needs at least {days} rows, got rows={world.cfg.rows}")
    out = _tsv_output(directory)
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; days=N writes a directory of day files")
    out.mkdir(exist_ok=True)
    spans = day_rows(world.cfg.rows, days)
    chunks = _chunks(world)
    pending: tuple[int, pa.Table] | None = None  # (its first global row, table) not yet written

    def day_tables(lo: int, hi: int) -> Iterator[pa.Table]:
        nonlocal pending
        while True:
            if pending is None:
                try:
                    start, chunk = next(chunks)
                except StopIteration:
                    return
                pending = (start, tsv_table(world, chunk))
            start, table = pending
            end = start + table.num_rows
            take = min(end, hi) - start
            if take > 0:
                yield table.slice(0, take)
            if end > hi:  # the rest belongs to the next day
                pending = (hi, table.slice(take))
                return
            pending = None
            if end == hi:
                return

    paths = []
    with _progress(progress, world.cfg.rows, "writing days") as bar:
        for d, (lo, hi) in enumerate(spans):
            paths.append(_write_tsv_file(out / (f"day_{d}.gz" if gz else f"day_{d}"), day_tables(lo, hi), bar))
    return paths


# --------------------------------------------------------------------------- the built-in dataset


def default_cache_dir() -> Path:
    env = os.environ.get("RECSYS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "recsys"


def default_dataset(cfg: SyntheticConfig, cache_dir: Path | None = None) -> Path:
    """The dataset directory for `cfg`, generated on first use under
    `cache_dir` (default $RECSYS_CACHE or ~/.cache/recsys) in
    `synthetic-<config hash>`; reused when present. Concurrent callers
    serialise on a lock file; a generator that loses a rename race uses the
    directory that appeared."""
    cfg = _coerce(cfg)
    validate(cfg)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write the dataset cache {cache} (RECSYS_CACHE, dataset.cache_dir): {e.strerror or e}") from None
    target = (cache / f"synthetic-{config_hash(cfg)}").absolute()
    if _valid(target):
        return target
    lock_path = cache / f".{target.name}.lock"
    try:  # the first write into the cache: a read-only one is one line naming it, before any work
        lock = open(lock_path, "w")
    except OSError as e:
        raise UserError(f"cannot write the dataset cache {cache} (RECSYS_CACHE, dataset.cache_dir): {e.strerror or e}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _valid(target):
                return target
            if target.exists():  # something broken: not ours to keep
                shutil.rmtree(target)
            _generate(cfg, target, if_exists="keep", progress=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def _valid(path: Path) -> bool:
    try:
        load_manifest(path)
        return True
    except Exception:
        return False
