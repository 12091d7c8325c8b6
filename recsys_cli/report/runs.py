"""The runs of a report: reading run directories (summary.json, metrics.jsonl,
.hydra/overrides.yaml), labelling them by the overrides that differ, and the
numbers the report shows of each, one row per run (report_rows). Pure Python:
no torch, no matplotlib.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from recsys_cli.errors import UserError

# The trainer's phases (recsys_cli.train.trainer.PHASES), in step order; kept
# here so the report does not import torch. Unknown phases follow these.
PHASE_ORDER = ("data_wait", "embedding_forward", "mlp_forward", "backward", "sparse_update", "dense_update", "eval")


# --- reading runs ------------------------------------------------------------------------
@dataclass
class Run:
    dir: Path
    rel: str  # the run directory relative to the report's DIR ("." for DIR itself)
    summary: dict
    overrides: list[str] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl records
    label: str = ""
    notes: list[str] = field(default_factory=list)

    # -- the numbers the report shows --------------------------------------------------
    @property
    def placement(self) -> str:
        return str(self.summary.get("placement") or config_value(self.summary, "placement", "kind") or "?")

    @property
    def precision(self) -> str:
        return str(self.summary.get("precision") or config_value(self.summary, "precision", "kind") or "?")

    @property
    def dataset(self) -> str:
        """The data the run trained on: the dataset config's name, and its path
        when it has one (two Criteo datasets are different data)."""
        cfg = (self.summary.get("config") or {}).get("dataset") or {}
        name, path = cfg.get("name") or "?", cfg.get("path")
        return f"{name} ({path})" if path else str(name)

    @property
    def group(self) -> str:
        return f"{self.placement} / {self.precision}"

    @property
    def steps(self) -> int | None:
        return number(self.summary.get("steps"))

    def final(self, split: str, metric: str) -> float | None:
        value = ((self.summary.get("final") or {}).get(split) or {}).get(metric)
        if value is None:  # an older or interrupted run: the last evaluation logged
            for record in reversed(self.metrics):
                if record.get("split") == split and metric in record:
                    value = record[metric]
                    break
        return number(value)

    @property
    def throughput(self) -> dict:
        return self.summary.get("throughput") or {}

    @property
    def steady_samples_per_second(self) -> float | None:
        """Training samples/s after the warm-up, evaluation and checkpoints
        left out; None for a summary written before it was measured (its
        samples_per_second is over the whole fit loop)."""
        return number(self.summary.get("samples_per_second")) if self.throughput else None

    @property
    def wall_samples_per_second(self) -> float | None:
        if self.throughput:
            return number(self.throughput.get("wall_samples_per_second"))
        return number(self.summary.get("samples_per_second"))  # older summaries: samples over the fit loop

    @property
    def train_loss(self) -> float | None:
        for record in reversed(self.metrics):
            if "split" not in record and "loss" in record:
                return number(record["loss"])
        return None

    @property
    def phase_seconds(self) -> dict[str, float]:
        phases = self.summary.get("phase_seconds") or {}
        return {k: float(v) for k, v in phases.items() if number(v) is not None}

    @property
    def cache(self) -> dict:
        return self.summary.get("cache") or {}

    @property
    def uses_cache(self) -> bool:
        return "hits" in self.cache or "cache_slots" in self.cache

    @property
    def window(self) -> int | None:
        """The lookahead window, or None for an on-demand cache."""
        if self.placement != "lookahead":
            return None
        return number(config_value(self.summary, "placement", "window"))

    @property
    def dedup_ratio(self) -> float | None:
        """Share of a batch's ids that repeat one already in the batch (RecD)."""
        dup = self.summary.get("duplication")
        if isinstance(dup, dict) and number(dup.get("duplicated_ids")) is not None:
            return dup["duplicated_ids"]
        return number(self.summary.get("dedup_ratio"))  # summaries before "duplication"

    @property
    def lookups_saved_by_dedup(self) -> float | None:
        dup = self.summary.get("duplication")
        return number(dup.get("lookups_saved_by_dedup")) if isinstance(dup, dict) else None

    @property
    def sharding(self) -> dict | None:
        """summary.json's "sharding" entry (ShardPlan.to_dict: a run with
        placement.sharding=table|row|auto; at the top or in "distributed"),
        None for a replicated run or an entry without per-rank bytes."""
        plan = self.summary.get("sharding")
        distributed = self.summary.get("distributed")
        if not isinstance(plan, dict) and isinstance(distributed, dict):
            plan = distributed.get("sharding")
        if not isinstance(plan, dict) or not isinstance(plan.get("rank_bytes"), list) or not plan["rank_bytes"]:
            return None
        if any(number(b) is None for b in plan["rank_bytes"]):
            return None
        return plan

    def sharding_per_rank(self) -> list[dict] | None:
        """One dict per rank of a sharded run: bytes, expected lookups per step
        and how many tables (or row ranges of tables) it holds."""
        plan = self.sharding
        if plan is None:
            return None
        n = len(plan["rank_bytes"])
        lookups = plan.get("rank_lookups")
        lookups = lookups if isinstance(lookups, list) and len(lookups) == n else [None] * n
        shards = [0] * n
        for shard in plan.get("shards") or []:
            if not isinstance(shard, dict):
                continue
            rank, rows = shard.get("rank"), shard.get("rows")
            empty = isinstance(rows, list) and len(rows) == 2 and rows[0] == rows[1]  # a range of no rows
            if isinstance(rank, int) and 0 <= rank < n and not empty:
                shards[rank] += 1
        return [{"bytes": plan["rank_bytes"][r], "lookups": number(lookups[r]), "shards": shards[r]} for r in range(n)]

    @property
    def sharding_imbalance(self) -> float | None:
        """The largest rank's bytes over the mean (the entry's, else from its rank_bytes)."""
        plan = self.sharding
        if plan is None:
            return None
        if number(plan.get("imbalance")) is not None:
            return plan["imbalance"]
        per_rank = plan["rank_bytes"]
        mean = sum(per_rank) / len(per_rank)
        return max(per_rank) / mean if mean else 1.0

    def cache_overhead_ms(self) -> float | None:
        """Trainer-visible cache cost: data_wait + embedding_forward, ms per step."""
        steps, phases = self.steps, self.phase_seconds
        if not steps or not phases:
            return None
        return 1000 * (phases.get("data_wait", 0.0) + phases.get("embedding_forward", 0.0)) / steps

    def cache_fill_ms(self) -> float | None:
        """Time the cache spent filling (prepare's work, without its waits
        for the trainer), ms per step; for lookahead it runs on the prefetch
        thread, overlapped with training."""
        steps, seconds = self.steps, number(self.cache.get("prepare_seconds"))
        if not steps or seconds is None:
            return None
        return 1000 * seconds / steps


def number(value):
    """`value` if it is a number (not a bool), else None: summaries of older runs lack fields."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def config_value(summary: dict, *keys):
    """summary["config"][key][key]..., None where a level is missing."""
    node = summary.get("config") or {}
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _natural_key(rel: str):
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"[/\\]", rel)]


def load_run(summary_path: Path, root: Path) -> Run:
    """Read one run directory; ValueError says why its summary.json is unusable
    (the message does not repeat the path)."""
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not readable as JSON ({e})") from None
    if not isinstance(summary, dict):
        raise ValueError(f"expected a JSON object, found {type(summary).__name__}")
    run_dir = summary_path.parent
    rel = run_dir.relative_to(root).as_posix() if run_dir != root else "."
    run = Run(dir=run_dir, rel=rel, summary=summary)
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if overrides.exists():
        import yaml

        try:
            loaded = yaml.safe_load(overrides.read_text())
            if loaded is None:
                loaded = []
            if not isinstance(loaded, list):
                raise ValueError("not a list")
            run.overrides = [str(o) for o in loaded]
        except (OSError, ValueError, yaml.YAMLError) as e:
            run.notes.append(f"{overrides}: unreadable overrides ({str(e).splitlines()[0]}); labelled by directory")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        try:
            for line in metrics.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed run
                if isinstance(record, dict):
                    run.metrics.append(record)
        except (OSError, UnicodeDecodeError):
            run.notes.append(f"{metrics}: unreadable")
    return run


def find_runs(root: Path) -> tuple[list[Run], list[tuple[Path, str]]]:
    """Every run below `root` (natural order: 2 before 10) and the summary.json
    files that were skipped, with why. UserError if root is missing or holds
    no summary.json at all."""
    root = Path(root)
    if not root.exists():
        raise UserError(f"recsys report: {root} does not exist")
    if not root.is_dir():
        raise UserError(f"recsys report: {root} is not a directory (give a run or multirun directory)")
    paths = sorted(root.rglob("summary.json"), key=lambda p: _natural_key(p.parent.relative_to(root).as_posix()))
    if not paths:
        raise UserError(
            f"recsys report: no summary.json in {root} or below it; give a run directory "
            "(outputs/DATE/TIME) or a sweep directory (multirun/DATE/TIME) of finished runs"
        )
    runs, skipped = [], []
    for path in paths:
        try:
            runs.append(load_run(path, root))
        except ValueError as e:
            skipped.append((path, str(e)))
    return runs, skipped


# --- labels ------------------------------------------------------------------------------
def _split_override(text: str) -> tuple[str, str]:
    key, _, value = text.partition("=")
    return key.lstrip("+~"), value


def run_labels(overrides: list[list[str]], fallbacks: list[str]) -> list[str]:
    """Short, unique labels: the overrides that differ between runs, keys cut
    to their last part (optimizer.lr=0.1 -> lr=0.1) where that is unambiguous."""
    parsed = [dict(_split_override(o) for o in run) for run in overrides]
    keys: list[str] = []
    for run in parsed:
        keys.extend(k for k in run if k not in keys)
    varying = [k for k in keys if len(parsed) == 1 or len({run.get(k) for run in parsed}) > 1]
    last = {k: k.rsplit(".", 1)[-1] for k in varying}
    short = {k: last[k] if list(last.values()).count(last[k]) == 1 else k for k in varying}
    labels = []
    for run, fallback in zip(parsed, fallbacks):
        parts = [f"{short[k]}={run[k]}" for k in varying if k in run]
        labels.append(" ".join(parts) or fallback)
    seen: dict[str, int] = {}
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
    return [f"{label} [{fb}]" if seen[label] > 1 else label for label, fb in zip(labels, fallbacks)]


# --- rows ------------------------------------------------------------------------------------
def phases_of(runs: list[Run]) -> list[str]:
    names = {p for run in runs for p in run.phase_seconds}
    return [p for p in PHASE_ORDER if p in names] + sorted(names - set(PHASE_ORDER))


def report_rows(runs: list[Run]) -> list[dict]:
    """One dict per run, in CSV column order."""
    phases = phases_of(runs)
    rows = []
    for run in runs:
        memory = run.summary.get("embedding_bytes") or {}
        row = {
            "run": run.label,
            "dir": run.rel,
            "overrides": " ".join(run.overrides),
            "placement": run.placement,
            "precision": run.precision,
            "steps": run.steps,
            "val_auc": run.final("val", "auc"),
            "val_logloss": run.final("val", "logloss"),
            "train_loss": run.train_loss,
            "samples_per_second": run.steady_samples_per_second,  # steady state
            "wall_samples_per_second": run.wall_samples_per_second,
            "wall_seconds": number(run.throughput.get("wall_seconds")),
            "eval_seconds": number(run.throughput.get("eval_seconds")),
            "checkpoint_seconds": number(run.throughput.get("checkpoint_seconds")),
            "device_bytes": number(memory.get("device")),
            "host_bytes": number(memory.get("host")),
            "cache_hit_rate": number(run.cache.get("hit_rate")),
            "dedup_ratio": run.dedup_ratio,
            "dedup_lookups_saved": run.lookups_saved_by_dedup,
            "cache_fill_ms_per_step": run.cache_fill_ms(),
            # the disk tier (placement disk): empty for runs without one
            "disk_bytes": number(memory.get("disk")),
            "disk_bytes_read_per_step": number(run.cache.get("disk_bytes_read_per_step")),
            "disk_bytes_written_per_step": number(run.cache.get("disk_bytes_written_per_step")),
            "disk_read_amplification": number(run.cache.get("disk_read_amplification")),
            "host_cache_hit_rate": number(run.cache.get("host_cache_hit_rate")),
            "disk_wait_seconds_per_step": number(run.cache.get("disk_wait_seconds_per_step")),
            # sharded tables (placement.sharding): empty for replicated runs; lists are one value per rank
            **_sharding_columns(run),
        }
        for phase in phases:
            row[f"seconds_{phase}"] = run.phase_seconds.get(phase)
        rows.append(row)
    return rows



def _sharding_columns(run: Run) -> dict:
    per_rank = run.sharding_per_rank()
    plan = run.sharding or {}
    return {
        "sharding": plan.get("kind") if per_rank else None,
        "sharding_ranks": len(per_rank) if per_rank else None,
        "sharding_imbalance": run.sharding_imbalance,
        "sharding_rank_bytes": [r["bytes"] for r in per_rank] if per_rank else None,
        "sharding_rank_lookups": [r["lookups"] for r in per_rank] if per_rank else None,
        "sharding_rank_shards": [r["shards"] for r in per_rank] if per_rank else None,
    }


def atomic_write(path: Path, data: bytes) -> None:
    """Write beside `path` under a temporary name, then rename over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise

