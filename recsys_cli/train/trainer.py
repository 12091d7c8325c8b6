"""The trainer: data -> embeddings -> DLRM -> loss -> row and dense updates.

Read top to bottom: Trainer.__init__ builds everything from the config,
fit() runs the epochs, train_step() is one step split into the phases the
run reports, evaluate() scores a split, save()/resume() checkpoint. How this
process trains with others is its Strategy's business (strategies/), never a
branch here. What the trainer is given rather than works out: the device
(device.resolve_device), the dataset (training_data.py), placement=auto's
plan (auto_placement.py); starting from a checkpoint is restore.py, which
returns what it restores and the trainer applies it. (Some 460 lines: the
loop, its evaluation, checkpoints and the run's summary belong together.)
"""

from __future__ import annotations

import functools
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from recsys_cli import checkpoints as ckpt
from recsys_cli import determinism, wait_policy
from recsys_cli.config import DROP_LAST_RANKS, check_precision_cache_ratio, no_effect_notes, validate
from recsys_cli.data.batch import Batch
from recsys_cli.data.loader import ShardLoader
from recsys_cli.device import (allocated_by, pageable_sites, require_dense_precision, resolve_device, runtime_for,
                               sum_copies)
from recsys_cli.embeddings.optim import RowOptimizer
from recsys_cli.embeddings.placement import build_embeddings, table_placements
from recsys_cli.embeddings.table_init import TableSpec
from recsys_cli.embeddings.sharded import build_sharded_embeddings
from recsys_cli.errors import UserError, say
from recsys_cli.model.dlrm import DLRM
from recsys_cli.train import distributed, restore, strategies
from recsys_cli.train.auto_placement import auto_placement, expected_lookups
from recsys_cli.train.dense_optim import DenseAdagrad, DenseOptimizer, DenseSGD
from recsys_cli.train.loggers import make_log
from recsys_cli.train.loop_control import LoopControl
from recsys_cli.train.memory import RSSTrace, peak_rss_bytes, return_free_memory
from recsys_cli.train.metrics import PhaseTimer, SplitPredictions, binary_metrics, write_json_atomic
from recsys_cli.train.preemption import Preempted, SigtermFlag
from recsys_cli.train.progress import TrainProgress
from recsys_cli.train.run_log import RunLog, StepLines
from recsys_cli.train.schedule import LRSchedule
from recsys_cli.train.threads import compute_threads, matmul_macs_per_sample
from recsys_cli.train.throughput import ThroughputMeter
from recsys_cli.train.training_data import training_data
from recsys_cli.train.transfer import BatchCopier, pinning

PHASES = ("data_wait", "embedding_forward", "mlp_forward", "backward", "communication", "sparse_update", "dense_update",
          "eval")


class Trainer:
    def __init__(self, cfg, run_dir: Path | None = None, console=None) -> None:
        validate(cfg)
        determinism.settle_vector_math()  # before the first parallel op of the data, the tables and the steps
        self.cfg = cfg
        self.run_dir = run_dir
        self.console = console
        tc = cfg.trainer
        self.dist = distributed.current()  # world_size 1 unless a process group is up
        # Lines for batch jobs: to the job log file, and to stdout when it is no terminal (run_log.py).
        self.run_log = RunLog(console if tc.progress else None, enabled=self.dist.is_main)
        for note in no_effect_notes(cfg, self.dist.world_size):  # options the config leaves without use (config.py)
            self.run_log.start_line(note, console)
        self.device = resolve_device(tc.device, one_of_many=self.dist.enabled)  # one device per process
        require_dense_precision(cfg.model.dense_precision, self.device)  # before any table is built
        # Memory refused up front (memory_plan.py): before the built-in data is generated, before any table.
        self.memory_plan = None if cfg.placement.kind == "auto" else self.check_memory()
        self.data = data = training_data(cfg)
        features, vocab_sizes = data.features, data.vocab_sizes
        if cfg.precision.cache_ratio is not None and cfg.placement.kind != "auto":  # the tables' real placements
            kinds = table_placements([TableSpec(f, n, cfg.model.embedding_dim) for f, n in zip(features, vocab_sizes)],
                                     cfg.placement)
            check_precision_cache_ratio(cfg, set(kinds.values()))

        torch.manual_seed(tc.seed)
        opt = cfg.optimizer
        row_optimizer = RowOptimizer(opt.name, opt.lr, opt.eps, opt.initial_accumulator)
        self.auto_placement = auto_placement(cfg, data, row_optimizer, self.device) if cfg.placement.kind == "auto" else None
        if self.auto_placement is not None and self.console is not None:
            self.console.print(self.auto_placement.table())
            for line in self.auto_placement.why_lines():  # whole lines: a terminal wraps them, a log keeps them greppable
                say(self.console, line, soft_wrap=True, highlight=False)
        if self.auto_placement is not None:  # the placements the search chose
            self.memory_plan = self.check_memory(self.auto_placement.build_arguments())
        self.runtime = runtime_for(self.device)
        # On CUDA the bytes per tier come from the allocators (device, pinned host), not from tensor sizes.
        # Sharded (placement.sharding): this rank builds only the shards it owns (embeddings/sharded.py).
        build = build_embeddings
        if self.dist.enabled and cfg.placement.sharding != "replicated":
            build = functools.partial(build_sharded_embeddings, rank=self.dist.rank,
                                      world_size=self.dist.world_size, group=self.dist.group,
                                      lookups=expected_lookups(data, tc.batch_size, tc.seed))
        embeddings, self.embedding_allocated = allocated_by(self.runtime, lambda: build(
            features, vocab_sizes, cfg.model.embedding_dim, cfg.placement, cfg.precision, row_optimizer,
            self.device, tc.seed, **(self.auto_placement.build_arguments() if self.auto_placement else {}),
            batch_ids={f.name: None if f.multi_hot else tc.batch_size for f in data.manifest.sparse_features},
        ))
        if self.console is not None and self.dist.is_main:
            if embeddings.shard_plan is not None:  # who owns which rows (placement.sharding)
                self.console.print(embeddings.shard_plan.table())
                for line in embeddings.shard_plan.why_lines():
                    say(self.console, line, soft_wrap=True, highlight=False)
            for line in embeddings.cache_sizes():
                say(self.console, line, soft_wrap=True)
        device_bytes = (self.embedding_allocated or embeddings.memory())["device"]
        if self.auto_placement is not None and device_bytes > self.auto_placement.budget_bytes:
            raise RuntimeError(  # the placement search's byte model and the allocation disagree: a bug, not bad input
                f"the table placements allocated {device_bytes} device bytes, over the budget {self.auto_placement.budget_bytes}"
            )
        self.model = DLRM(
            len(data.manifest.dense_features), embeddings, list(cfg.model.bottom_mlp), list(cfg.model.top_mlp),
            cfg.model.interaction, cfg.model.init, cfg.model.dcn_layers, cfg.model.dcn_rank, seed=tc.seed,
            compile=cfg.model.compile, dense_precision=cfg.model.dense_precision,
        ).to(self.device)
        self.embeddings = embeddings
        self.row_optimizer = row_optimizer
        strategies.check(cfg, embeddings)
        # torch.optim's foreach SGD and Adagrad, bit for bit, without importing torch._dynamo (dense_optim.py)
        self.dense_optimizer: DenseOptimizer
        if opt.name == "sgd":
            self.dense_optimizer = DenseSGD(self.model.parameters(), lr=opt.lr)
        else:
            self.dense_optimizer = DenseAdagrad(
                self.model.parameters(), lr=opt.lr, eps=opt.eps, initial_accumulator_value=opt.initial_accumulator,
                fused=opt.dense_kernel == "fused",
            )

        # Plans are made on the loader thread; on CUDA the batch and its plans are also pinned there.
        self.copier = BatchCopier(self.device, self.runtime)
        transform = embeddings.plan_batch
        if self.device.type == "cuda":
            pin = pinning(self.copier.runtime)
            transform = lambda batch: pin(embeddings.plan_batch(batch))  # noqa: E731
        loader_args = dict(transform=transform, dedup=cfg.dedup.enabled, queue_depth=tc.loader_queue_depth,
                           rank=self.dist.rank, world_size=self.dist.world_size)  # each rank: its slice of a global batch
        if not tc.drop_last and self.dist.enabled:
            raise UserError(DROP_LAST_RANKS)
        self.train_loader = ShardLoader(
            data.directory, "train", tc.batch_size, shuffle=True, seed=tc.seed, drop_last=tc.drop_last,
            keep_sessions=data.keep_sessions, **loader_args,
        )
        left_out = self.train_loader.num_rows % tc.batch_size
        if tc.drop_last and left_out and self.console is not None and self.dist.is_main:
            self.console.print(f"trainer.drop_last=true: each epoch leaves out its last {left_out:,} of "
                               f"{self.train_loader.num_rows:,} train rows (a partial batch; which rows, the epoch's "
                               "shuffle decides); trainer.drop_last=false trains on them as a smaller batch",
                               soft_wrap=True, highlight=False)
        splits = data.manifest.splits
        self.eval_loaders: dict[str, ShardLoader] = {
            split: ShardLoader(data.directory, split, tc.eval_batch_size, shuffle=False, drop_last=False, **loader_args)
            for split in ("val", "test") if split in splits and splits[split].rows > 0
        }
        per_epoch = self.train_loader.num_batches
        self.total_steps = tc.epochs * per_epoch if tc.max_steps is None else min(tc.max_steps, tc.epochs * per_epoch)
        if self.total_steps < 1:
            raise UserError(
                f"no training steps: {splits['train'].rows} train rows at "
                f"trainer.batch_size={tc.batch_size}"
            )
        self.schedule = LRSchedule.from_config(opt, self.total_steps)
        self.control = LoopControl(tc)  # best checkpoint, early stopping, AUC threshold
        self.check_loop_rules()
        self.stopping = False
        self.last_validation: tuple[int, dict] | None = None

        self.timer = PhaseTimer(self.device, self.runtime)
        self.rss = RSSTrace()  # summary.json's memory: RSS at every log step
        self.log = make_log(tc.logger, run_dir, self.dist.is_main)
        self.progress: TrainProgress | None = None
        self.checkpoint_dir = Path(tc.checkpoint_dir) if tc.checkpoint_dir else (run_dir / "checkpoints" if run_dir else None)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.samples = 0
        self.train_seconds = 0.0
        self.running_loss, self.running_steps = torch.zeros((), device=self.device), 0  # since the last log line
        self.saved_step: int | None = None
        self.step_losses: list[float] = []  # every step's loss, kept for tests and exactness checks
        self.record_losses = False
        self.evals: list[dict] = []
        self.window_used: list[int] = []
        self.id_counts = torch.zeros(3, len(features), dtype=torch.int64)  # batch ids, looked up, distinct
        # Training-batch calibration: sums of predicted probabilities and of labels, and their count.
        self.train_ctr = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.train_ctr_samples = 0
        if tc.resume and tc.init_from:
            raise UserError("trainer.resume continues a run, trainer.init_from starts a new one from a checkpoint: "
                            "give one of them (a run that started from trainer.init_from continues with "
                            "trainer.resume alone: its checkpoints hold what it started from)")
        saved_strategy = None
        if tc.resume:
            saved_strategy = self.resume(tc.resume)
            self.mark_best_after_resume()
        elif tc.init_from:
            self.init_from(tc.init_from)
        # How this process trains with the others (alone, grad or cache_avg): after a resume,
        # so cache_avg starts from the restored caches, step and (if it saved them) sync points.
        self.strategy = strategies.strategy_for(cfg, self.dist, self.model, self.timer, step=self.step,
                                                saved=saved_strategy)

    def check_memory(self, chosen: dict | None = None) -> dict | None:
        """What this run will hold against what the process may use: a run
        that cannot fit is refused in one line (memory_plan.check). Returns
        the plan and the RSS it adds to, for summary.json."""
        from recsys_cli.train import memory_plan
        from recsys_cli.train.memory import current_rss_bytes

        tables = memory_plan.tables_of(self.cfg)
        if tables is None:  # a dataset that does not load: training_data says why
            return None
        room = memory_plan.available(self.device)
        local = max(self.dist.local_world_size, 1)  # the processes on this machine share its memory
        if local > 1 and room.host is not None:
            room = memory_plan.Room(room.host // local, f"{room.host_why}, shared by {local} processes",
                                    room.device, room.device_why)
        chosen = dict(chosen or {})
        plan = memory_plan.check(self.cfg, tables, room, on_device=self.device.type != "cpu",
                                 world_size=self.dist.world_size,
                                 sharded=self.dist.enabled and self.cfg.placement.sharding != "replicated",
                                 placements=chosen.get("placements"), precisions=chosen.get("precisions"),
                                 cache_rows=chosen.get("cache_rows"))
        return {**plan.as_dict(), "rss_before_bytes": current_rss_bytes(), "available_host_bytes": room.host,
                "available_device_bytes": room.device}

    # --- training ------------------------------------------------------------
    def fit(self) -> dict:
        busy = 1 + any(getattr(g, "lookahead", False) for g in self.embeddings.groups) + self.dist.enabled  # threads
        rank_batch = self.cfg.trainer.batch_size // self.dist.world_size  # each rank steps on its slice
        step_macs = matmul_macs_per_sample(self.model) * rank_batch
        with compute_threads(self.cfg.trainer.threads, busy, self.dist.local_world_size, step_macs) as self.compute_threads, \
                SigtermFlag() as self.sigterm:
            return self._fit()

    def _fit(self) -> dict:
        tc = self.cfg.trainer
        # The bar on a terminal; elsewhere the run log's lines say the same (run_log.py).
        bar = tc.progress and self.dist.is_main and (self.console is None or self.console.is_terminal)
        self.progress = progress = TrainProgress(self.total_steps, self.step, enabled=bar, console=self.console)
        lines = StepLines(self.run_log, self.total_steps, self.step)
        last_log, last_samples = time.perf_counter(), self.samples
        start = time.perf_counter()
        self.throughput = ThroughputMeter(self.total_steps - self.step, sync=self.runtime.current_stream().synchronize)
        self.throughput.start(self.samples)
        self.stop_at: int | None = None  # the step a SIGTERM stops the run after, once the ranks agree on it
        with progress:
            while self.step < self.total_steps and not self.stopping:
                batches = self.epoch_batches()
                while True:
                    with self.timer.phase("data_wait"):
                        batch = next(batches, None)
                    if batch is None:
                        break
                    loss = self.train_step(batch)
                    self.throughput.step(self.samples)
                    self.running_loss += loss.detach()
                    self.running_steps += 1
                    if self.record_losses:
                        self.step_losses.append(loss.item())
                    if self.step % tc.log_every == 0 or self.step == self.total_steps:
                        mean_loss = (self.running_loss / self.running_steps).item()
                        self.timer.collect()  # read the phase events here, where the loss is read anyway
                        self.check_finite(mean_loss)
                        now = time.perf_counter()
                        rate = (self.samples - last_samples) / (now - last_log)  # a partial batch counts its rows
                        self.log.write(self.step_record(mean_loss, rate))
                        self.rss.sample(self.step)
                        progress.update(self.step, mean_loss, rate)
                        lines.step(self.step, self.epoch, mean_loss, rate)
                        self.running_loss.zero_()
                        self.running_steps, last_log, last_samples = 0, now, self.samples
                    epoch_end = tc.eval_each_epoch and self.batch_in_epoch >= self.train_loader.num_batches
                    if ((tc.eval_every and self.step % tc.eval_every == 0) or epoch_end) and self.step < self.total_steps \
                            and "val" in self.eval_loaders:
                        with self.throughput.paused("eval"):
                            self.validate()
                    if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 and self.saved_step != self.step:
                        self.check_finite((self.running_loss / max(self.running_steps, 1)).item())
                        with self.throughput.paused("checkpoint"):
                            self.save()
                    if self.stop_at is None and self.sigterm_received():
                        self.stop_at = self.agree_stop_step()
                    if self.stop_at is not None and self.step >= self.stop_at:
                        self.stop_preempted()
                    self.feed.passed(self.step)  # the prefetcher may fill the next step's batch
                    if self.step >= self.total_steps or self.stopping:
                        batches.close()
                        break
            self.throughput.end_training(self.samples)
            self.train_seconds += time.perf_counter() - start
            # The trained model is saved before the final evaluation: an evaluation
            # that fails (a damaged val/test shard) never costs the training.
            if self.checkpoint_dir is not None and self.saved_step != self.step and tc.final_checkpoint:
                with self.throughput.paused("checkpoint"):
                    self.save()
            with self.throughput.paused("eval"):
                final = {split: self.final_validation() if split == "val" else self.evaluate_and_log(split)
                         for split in self.eval_loaders}
        self.progress = None
        return self.summary(final)

    # --- preemption (train/preemption.py) ---------------------------------------------
    def sigterm_received(self) -> bool:
        """Whether any rank has had a SIGTERM: every rank asks at every step
        boundary (one small host collective when distributed), so all learn
        it at the same step."""
        received = self.sigterm.requested
        return distributed.agree_max(int(received)) > 0 if self.dist.enabled else received

    def agree_stop_step(self) -> int:
        """The step to stop after: the first one whose batch no rank's
        prefetcher has filled yet, so the checkpoint there saves caches
        holding no later batch, as at a checkpoint_every step (the prefetcher
        holds until the ranks agree, then pauses there)."""
        hold = getattr(self.feed, "hold", None)
        proposal = max(hold(), self.step) if hold is not None else self.step
        stop = min(distributed.agree_max(proposal), self.total_steps)
        if hold is not None:
            self.feed.stop_after(stop)
        return stop

    def stop_preempted(self) -> None:
        """Write the checkpoint of this step and raise Preempted saying where."""
        if self.checkpoint_dir is None:
            raise Preempted(f"SIGTERM: stopped after step {self.step} of {self.total_steps}; no checkpoint "
                            "was written (the run has no checkpoint directory)")
        if self.saved_step != self.step:
            with self.throughput.paused("checkpoint"):
                self.save()
        path = self.checkpoint_dir / f"step-{self.step:08d}.pt"
        # a run started with trainer.init_from: repeating it beside trainer.resume is refused (__init__)
        same = "same overrides but trainer.init_from" if self.cfg.trainer.init_from else "same overrides"
        raise Preempted(f"SIGTERM: stopped after step {self.step} of {self.total_steps} and saved {path}; "
                        f"continue with trainer.resume=true ({same})")

    def step_record(self, loss: float, rate: float) -> dict:
        """What a log line says: loss, speed, the cache's hit rate so far, and the seconds spent per phase."""
        record: dict[str, object] = {"step": self.step, "epoch": self.epoch, "loss": loss, "samples_per_second": rate,
                  "lr": self.schedule.lr(self.step)}
        hit_rate = self.embeddings.stats().get("hit_rate")
        if hit_rate is not None:
            record["hit_rate"] = hit_rate
        record["phase_seconds"] = {p: self.timer.seconds.get(p, 0.0) for p in PHASES}
        return record

    def epoch_batches(self):
        """The rest of the current epoch, planned and (for lookahead) prefetched.
        Advances the epoch counter when the epoch is used up."""
        if self.batch_in_epoch >= self.train_loader.num_batches:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        self.train_loader.load_state_dict({"epoch": self.epoch, "batch": self.batch_in_epoch, "seed": self.cfg.trainer.seed})
        # Exactly the batches this run trains: a prefetcher must not fill a batch past the last step.
        limit = min(self.train_loader.num_batches - self.batch_in_epoch, self.total_steps - self.step)
        self.feed = feed = self.strategy.batches(self.train_loader, limit, self.step, self.pauses_at)
        with feed as batches:
            try:
                yield from batches
            finally:  # also when the caller stops early (max_steps)
                self.window_used.extend(batches.window_used)
                # The feed holds self.pauses_at: kept, it would tie the
                # trainer (and its tables) into a cycle only gc.collect frees.
                self.feed = None
        if self.batch_in_epoch >= self.train_loader.num_batches:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def set_lr(self, lr: float) -> None:
        """The rate of the next step, for dense parameters and rows alike."""
        for group in self.dense_optimizer.param_groups:
            group["lr"] = lr
        self.row_optimizer.lr = lr

    def pauses_at(self, step: int) -> bool:
        """Steps after which the trainer evaluates or checkpoints: the prefetcher
        waits there, so both see a cache holding no later batch."""
        tc = self.cfg.trainer
        return bool((tc.eval_every and step % tc.eval_every == 0) or (tc.checkpoint_every and step % tc.checkpoint_every == 0))

    def train_step(self, batch: Batch) -> torch.Tensor:
        timer, model = self.timer, self.model
        if self.schedule.kind != "constant":
            self.set_lr(self.schedule.lr(self.step + 1))
        batch = self.to_device(batch)
        with timer.phase("embedding_forward"):
            self.embeddings.prepare(batch)  # on-demand caches fill here; lookahead ones were filled ahead
            pooled = model.embeddings(batch)
        with timer.phase("mlp_forward"):
            logits = model.dense_forward(batch.dense, pooled)
            self.train_ctr += torch.stack([torch.sigmoid(logits.detach()).sum(), batch.labels.sum()]).double()
            self.train_ctr_samples += batch.size
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            loss = loss * self.strategy.loss_scale(batch)  # this rank's share of the global batch's mean
        with timer.phase("backward"):
            self.dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
        loss = self.strategy.reduce_gradients(loss)  # across ranks: gradients and the reported loss
        with timer.phase("sparse_update"):
            self.embeddings.step()
            self.embeddings.release(batch)
        with timer.phase("dense_update"):
            self.dense_optimizer.step()
        self.count_dedup(batch)
        self.step += 1
        self.batch_in_epoch += 1
        self.samples += self.strategy.samples(batch)
        self.strategy.after_step(self.step)
        return loss

    def to_device(self, batch: Batch) -> Batch:
        return self.copier.to_device(batch)  # Batch.to; on CUDA on the copy stream, overlapping the previous step

    def count_dedup(self, batch: Batch) -> None:
        if batch.id_counts is not None:  # a deduplicated batch's (the loader counts as it deduplicates)
            self.id_counts += batch.id_counts

    def duplication(self) -> dict:
        """RecD's measure: the share of a batch's ids that repeat a value
        already in the batch (per feature and overall), and the share of
        lookups that deduplicated bags saved."""
        # every rank's counts where ranks count different tables (sharded: each owner its own)
        batch_ids, looked_up, distinct = self.strategy.id_counts(self.id_counts).double()
        ratio = lambda a, b: (1 - a / b).item() if b > 0 else 0.0  # noqa: E731
        return {
            "duplicated_ids": ratio(distinct.sum(), batch_ids.sum()),
            "duplicated_ids_per_feature": {f: ratio(distinct[i], batch_ids[i]) for i, f in enumerate(self.embeddings.features)},
            "lookups_saved_by_dedup": ratio(looked_up.sum(), batch_ids.sum()),
        }

    def counts_per_rank(self) -> list[dict]:
        """Every rank's counts over the training batches so far (its id counts
        and its predicted, clicked and samples sums), in rank order: what
        duplication() and train_calibration() report, kept in a checkpoint so
        that a resumed run reports what the uninterrupted one does (it
        reported the batches after the resume only). Every rank calls it."""
        ctr = torch.cat([self.train_ctr.cpu(), torch.tensor([float(self.train_ctr_samples)], dtype=torch.float64)])
        ids = self.strategy.per_rank(self.id_counts.flatten())
        ctrs = self.strategy.per_rank(ctr)
        return [{"id_counts": i.cpu().view(self.id_counts.shape), "train_ctr": c.cpu()} for i, c in zip(ids, ctrs)]

    def restore_counts(self, saved: list, path: Path) -> None:
        """This rank's counts from a checkpoint's counts_per_rank: its own
        when as many ranks saved it, else (another process count) rank 0
        takes their sum and the others start from zero."""
        try:
            if len(saved) == self.dist.world_size:
                mine = saved[self.dist.rank]
                ids, ctr = mine["id_counts"], mine["train_ctr"]
            else:
                ids = sum((s["id_counts"] for s in saved), torch.zeros_like(self.id_counts))
                ctr = sum((s["train_ctr"] for s in saved), torch.zeros(3, dtype=torch.float64))
                if self.dist.rank != 0:
                    ids, ctr = torch.zeros_like(ids), torch.zeros_like(ctr)
            if ids.shape != self.id_counts.shape or ctr.shape != (3,):
                raise ValueError(f"shapes {tuple(ids.shape)} and {tuple(ctr.shape)}")
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
            raise UserError(f"checkpoint {path}: its train_counts do not fit this run ({e})") from None
        self.id_counts = ids.to(self.id_counts.dtype).clone()
        self.train_ctr = ctr[:2].to(self.train_ctr.device, torch.float64).clone()
        self.train_ctr_samples = int(ctr[2])

    def train_calibration(self) -> dict:
        """Mean predicted CTR beside the observed CTR of the training batches
        (predictions made before each update), every rank's slice of them
        (every rank calls it)."""
        ctr = torch.cat([self.train_ctr.cpu(), torch.tensor([float(self.train_ctr_samples)], dtype=torch.float64)])
        total = functools.reduce(torch.add, [c.cpu() for c in self.strategy.per_rank(ctr)])  # in rank order
        predicted, clicks, count = total.tolist()
        samples = int(count)
        return {"predicted_ctr": predicted / samples if samples else None,
                "observed_ctr": clicks / samples if samples else None, "samples": int(samples)}

    def check_finite(self, loss: float) -> None:
        if not math.isfinite(loss):
            record = ckpt.read_latest(self.checkpoint_dir) if self.checkpoint_dir else None
            if record is not None:
                step = record["step"]
                where = (f"; the last good checkpoint (step {step}) is in {self.checkpoint_dir}: "
                         "resume with trainer.resume=true")
            else:
                where = "; no checkpoint was written (trainer.checkpoint_every=N saves one every N steps)"
            raise UserError(f"loss is {loss} at step {self.step} (try a smaller optimizer.lr){where}")

    # --- evaluation ------------------------------------------------------------
    def evaluate(self, split: str) -> dict:
        return self.metrics(*self.predictions(split))

    def metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict:
        """The metrics of a split's predictions."""
        result = binary_metrics(logits, labels)
        return_free_memory()  # its temporaries' pages: RSS must not grow with each evaluation
        return result

    @torch.no_grad()
    def predictions(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits and labels of every row of `split`, in the split's order."""
        self.model.eval()
        loader = self.eval_loaders[split]
        # What training freed (its loader's row groups, the batches in flight)
        # goes back before the evaluation's own working set is added to it.
        return_free_memory()
        predictions = SplitPredictions(loader.num_rows)  # this rank's share is at most the split
        self.strategy.before_eval()
        bar = self.progress.evaluation(split, loader.num_batches) if self.progress else nullcontext(lambda: None)
        with self.timer.phase("eval"), bar as advance:
            for batch in self.strategy.eval_batches(loader):
                batch = self.to_device(batch)
                predictions.add(self.model(batch), batch.labels)
                advance()
        self.model.train()
        return_free_memory()  # the batches' pages, before the metrics sort the split
        # The whole split: every rank's predictions.
        return self.strategy.gather_predictions(*predictions.result())

    def check_loop_rules(self) -> None:
        """The rules that act on validations need validations to act on."""
        tc = self.cfg.trainer
        rules = [k for k, on in (("keep_best", tc.keep_best), ("early_stop_patience", tc.early_stop_patience),
                                 ("stop_at_auc", tc.stop_at_auc)) if on]
        if rules and "val" not in self.eval_loaders:
            raise UserError(f"trainer.{rules[0]} decides on validations, but {self.data.directory} has no val rows")
        if tc.eval_every and "val" not in self.eval_loaders:  # it was ignored without a word
            raise UserError(f"trainer.eval_every={tc.eval_every} validates on the val split, but "
                            f"{self.data.directory} has no val rows: leave trainer.eval_every unset")
        stops = [r for r in rules if r != "keep_best"]
        if stops and not tc.eval_every and not (tc.eval_each_epoch and tc.epochs > 1):
            raise UserError(f"trainer.{stops[0]} stops on a validation during the run: set trainer.eval_every=N "
                            "(or train several epochs with trainer.eval_each_epoch=true)")

    def validate(self, final: bool = False) -> dict:
        """Evaluate the val split and let the loop rules decide: a new best
        checkpoint (keep_best), a stop (early stopping, stop_at_auc). The
        final validation may mark the best, not stop."""
        result = self.evaluate_and_log("val")
        self.last_validation = (self.step, result)
        decision = self.control.after_validation(self.step, result)
        tc = self.cfg.trainer
        if decision.improved and tc.keep_best and self.checkpoint_dir is not None:
            if self.saved_step != self.step:
                with self.throughput.paused("checkpoint"):
                    self.save()
            self.mark_best()
        if decision.stop and not final:
            self.stopping = True
            self.run_log.line(f"stopping at step {self.step}: {decision.stop}")
            if self.console is not None and self.dist.is_main and self.console.is_terminal:
                say(self.console, f"stopping at step {self.step}: {decision.stop}", soft_wrap=True, highlight=False)
        return result

    def final_validation(self) -> dict:
        """The end of the run's val result: a run that stopped on a validation
        has it already (the same step, the same weights)."""
        if self.last_validation is not None and self.last_validation[0] == self.step:
            return self.last_validation[1]
        return self.validate(final=True)

    def mark_best(self) -> None:
        """checkpoints/best.json names this step's checkpoint (rank 0 writes)."""
        # called once a new best is saved: there is a checkpoint directory and a best value
        if self.dist.is_main and self.checkpoint_dir is not None and self.control.best is not None:
            ckpt.mark_best(self.checkpoint_dir, self.step, self.control.metric, self.control.mode, self.control.best,
                           keep=self.cfg.trainer.keep_last)

    def mark_best_after_resume(self) -> None:
        """A run killed between saving a new best and naming it in best.json
        names it now: the checkpoint's loop state knows which step it was."""
        best = self.control.best_step
        if self.cfg.trainer.keep_best and best is not None and self.checkpoint_dir is not None and self.dist.is_main \
                and self.control.best is not None:
            if ckpt.best_step(self.checkpoint_dir) != best and (self.checkpoint_dir / ckpt.step_file(best)).is_file():
                ckpt.mark_best(self.checkpoint_dir, best, self.control.metric, self.control.mode, self.control.best,
                               keep=self.cfg.trainer.keep_last)

    def evaluate_and_log(self, split: str) -> dict:
        rows = self.eval_loaders[split].num_rows
        self.run_log.line(f"eval {split} at step {self.step}: {rows:,} rows")
        started = time.perf_counter()
        result = self.evaluate(split)
        self.run_log.line(f"eval {split} at step {self.step}: AUC {result['auc']:.4f} log loss {result['logloss']:.4f} "
                          f"({time.perf_counter() - started:.1f} s)")
        record = {"step": self.step, "split": split, **result}
        self.evals.append(record)
        self.log.write(record)
        return result

    # --- checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "samples": self.samples,
            "model": {k: v for k, v in self.model.state_dict().items()},
            "dense_optimizer": self.dense_optimizer.state_dict(),
            # a snapshot (the live cache and store do not change), and the caches' slots and fp32 rows,
            # so a resumed run continues exactly; a sharded run's are in the shard directory beside it
            **dict(zip(("tables", "caches"), self.strategy.checkpoint_tables())),
            "strategy": self.strategy.state_dict(),  # its mode and process count; cache_avg's sync points
            "torch_rng": torch.get_rng_state(),
            "features": restore.feature_sizes(self.data),
            # what `recsys predict` needs to map raw rows: the dataset's vocabulary, and where rows lived
            "dataset_dir": str(self.data.directory.absolute()),
            "vocabulary": self.data.manifest.options.get("vocabulary", {}).get("fingerprint"),
            "table_tiers": {t.name: g.store_tier for g in self.embeddings.groups for t in g.tables},
            "metrics": list(self.log.lines),  # metrics.jsonl up to here: a resumed run rewinds it
            "running_loss": (self.running_loss.cpu(), self.running_steps),  # the next log line's mean
            "loop": self.control.state_dict(),  # best so far, validations since: a resume decides the same
            "config": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True),  # plain words, no Enum classes
        }

    def save(self) -> Path | None:
        directory = self.checkpoint_dir
        if directory is None:
            return None
        self.saved_step = self.step
        counts = self.counts_per_rank()  # every rank's (a small all-gather): rank 0 writes them
        # Distributed: rank 0 writes (every rank restores), the others wait for it.
        path = self.strategy.checkpoint(lambda: ckpt.save_checkpoint(
            directory, self.step, {**self.state_dict(), "train_counts": counts}, keep=self.cfg.trainer.keep_last),
                                        directory, self.step)
        return_free_memory()  # the save's buffers, as after an evaluation
        return path

    def restorable(self) -> restore.Restorable:
        return restore.Restorable(self.model, self.dense_optimizer, self.embeddings)

    def resume(self, resume: str) -> dict | None:
        """Continue the run saved at `resume` (a checkpoint, a directory, or "true": the latest);
        returns the saving run's strategy state, for this run's strategy."""
        path = restore.resume_path(resume, self.checkpoint_dir, self.run_dir)
        at = restore.resume(path, self.cfg, self.data, self.restorable())
        self.step, self.epoch, self.batch_in_epoch, self.samples = at.step, at.epoch, at.batch_in_epoch, at.samples
        self.control.load_state_dict(at.loop)
        if at.metrics is not None:
            self.log.restore(at.metrics)
        if at.running_loss is not None:  # saved with the metrics
            self.running_loss, self.running_steps = at.running_loss.to(self.device), at.running_steps
        if at.train_counts is not None:
            self.restore_counts(at.train_counts, path)
        self.saved_step = self.step
        if self.console is not None:
            say(self.console, f"resumed from {path} at step {self.step}{_mode_change(at.strategy, self.cfg, self.dist)}")
        return at.strategy

    def init_from(self, location: str) -> None:
        """Weights and optimizer state from a checkpoint, into this new run (restore.py)."""
        path, trained = restore.init_from(location, self.cfg, self.data, self.restorable())
        if self.console is not None:
            say(self.console, f"initialised from {path} (trained {trained} steps)")

    # --- the report --------------------------------------------------------------
    def summary(self, final: dict) -> dict:
        cfg = self.cfg
        peak_rss = peak_rss_bytes()
        copies = sum_copies([self.runtime, *self.embeddings.runtimes()]) if self.device.type != "cpu" else None
        summary = {
            "steps": self.step,
            "samples": self.samples,
            # steady state: after the warm-up steps, evaluations and checkpoints left out (train/throughput.py)
            "samples_per_second": self.throughput.samples_per_second,
            "throughput": self.throughput.report(self.samples),
            "train_seconds": self.train_seconds,
            "compute_threads": self.compute_threads,
            "openmp_wait": wait_policy.in_force(),
            "final": final,
            "phase_seconds": {p: self.timer.seconds.get(p, 0.0) for p in PHASES},
            "embedding_bytes": self.embeddings.memory(),
            "peak_host_rss_bytes": peak_rss,
            "memory_plan": self.memory_plan,  # what the start-up check expected the run to hold (memory_plan.py)
            "memory": self.rss.report(),
            "embedding_bytes_allocated": self.embedding_allocated,  # CUDA: measured by the allocators
            "peak_device_bytes": (self.runtime.allocated() or {}).get("device_peak"),
            "peak_pinned_host_bytes": (self.runtime.allocated() or {}).get("pinned_host_peak"),
            # every copy between host and device, by direction and pinned or pageable (None on CPU)
            "host_device_copies": copies,
            "pageable_host_to_device_copies": None if copies is None else copies["host_to_device_pageable"],
            "pageable_copy_sites": None if copies is None else pageable_sites([self.runtime, *self.embeddings.runtimes()]),
            "device": str(self.device),
            "placement": cfg.placement.kind,
            "precision": cfg.precision.kind,
            "dedup": cfg.dedup.enabled,
            "session_shuffle": self.data.keep_sessions,  # batches hold whole sessions
            "session_column": self.data.manifest.session_column,  # the dataset's, or None
            "cache": self.embeddings.stats(),
            "auto_placement": None if self.auto_placement is None else {
                "budget_bytes": self.auto_placement.budget_bytes, "expected_bytes": self.auto_placement.expected_bytes,
                "placements": self.auto_placement.placements, "cache_rows": self.auto_placement.cache_rows, "reasons": self.auto_placement.reasons,
            },
            "duplication": self.duplication(),
            # best validation so far, and why the run stopped before its last step (if it did)
            "loop": {**self.control.report(), "best_checkpoint": ckpt.best_file(self.checkpoint_dir),
                     "drop_last": cfg.trainer.drop_last},
            "train_calibration": self.train_calibration(),
            "config": OmegaConf.to_container(cfg, resolve=True),
        }
        if "disk_bytes_read" in summary["cache"] and self.step:  # the disk tier, per training step
            for key in ("disk_bytes_read", "disk_bytes_written", "disk_wait_seconds"):
                summary["cache"][f"{key}_per_step"] = summary["cache"][key] / self.step
        if self.window_used:
            summary["cache"]["window_used_min"] = min(self.window_used)
            summary["cache"]["window_used_mean"] = sum(self.window_used) / len(self.window_used)
        distributed_report = self.strategy.report()
        if distributed_report is not None:
            summary["distributed"] = distributed_report
        sharding = self.strategy.sharding()
        if sharding is not None:
            summary["sharding"] = sharding
        if self.run_dir is not None and self.dist.is_main:
            write_json_atomic(self.run_dir / "summary.json", summary)
        self.log.close()
        return summary


def _mode_change(saved: dict | None, cfg, dist) -> str:
    """How the resumed run trains differently from the saving one ("" if alike):
    any change works, the caches were averaged when the checkpoint was taken."""
    if not saved or saved.get("world_size") is None:
        return ""
    now = (strategies.mode_for(cfg, dist), dist.world_size if dist.enabled else 1)  # the mode it trains in
    was = (saved["mode"], saved["world_size"])
    if now == was:
        return ""
    return f" (saved by {was[1]} process(es) in {was[0]} mode, continuing with {now[1]} in {now[0]} mode)"
