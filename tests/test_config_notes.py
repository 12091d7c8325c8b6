"""Options the rest of the config leaves without effect (config.no_effect_notes):
each rule's note when the option is set and unused, none when it is used or
left at its default, and `recsys train` printing the line once (and in
app.log) while the run goes on. Notes, not errors: a resumed run re-applies
its saved overrides and may change placement or trainer.nproc."""

from __future__ import annotations

import io
import re

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from commands import train_in_process
from recsys_cli.config import TrainConfig, no_effect_notes
from test_configs import compose_train, group_options, option_override

# (overrides, processes, the note): one case per rule
NOTED = [
    (["placement=device", "placement.cache_rows=1000"], None,
     "note: placement.cache_rows=1000 has no effect with placement=device (only cache, lookahead and disk use it)"),
    (["placement=host", "placement.cache_ratio=0.1"], None,
     "note: placement.cache_ratio=0.1 has no effect with placement=host (only cache, lookahead and disk use it)"),
    (["placement=auto", "placement.cache_rows=1000"], None,
     "note: placement.cache_rows=1000 has no effect with placement=auto (its search sizes every cache)"),
    (["placement=lookahead", "placement.cache_rows=1000", "placement.cache_ratio=0.1"], None,
     "note: placement.cache_ratio=0.1 has no effect with placement.cache_rows=1000 (cache_rows sizes the cache)"),
    (["placement=cache", "placement.window=8"], None,
     "note: placement.window=8 has no effect with placement=cache (only lookahead and disk prefetch batches ahead)"),
    (["placement=uvm", "placement.policy=lfu"], None, "note: placement.policy=lfu has no effect with placement=uvm"),
    (["placement=device", "placement.device_max_rows=100"], None,
     "note: placement.device_max_rows=100 has no effect with placement=device (every table is on the device already)"),
    (["placement=auto", "placement.device_max_rows=100"], None,
     "note: placement.device_max_rows=100 has no effect with placement=auto (its search places every table)"),
    (["placement=auto", "+placement.overrides.C3=disk"], None,
     "note: placement.overrides.C3=disk has no effect with placement=auto (its search places every table)"),
    (["placement=lookahead", "placement.device_memory_budget=64MiB"], None,
     "note: placement.device_memory_budget=64MiB has no effect with placement=lookahead (only placement=auto, "
     "and placement.sharding over several processes, use it)"),
    (["placement=disk", "placement.host_memory_budget=1GiB"], None,
     "note: placement.host_memory_budget=1GiB has no effect with placement=disk (only placement=auto uses it)"),
    (["placement=lookahead", "placement.disk_path=/tmp"], None,
     "note: placement.disk_path=/tmp has no effect with placement=lookahead (only disk uses it)"),
    (["placement=device", "placement.host_cache_rows=100"], None,
     "note: placement.host_cache_rows=100 has no effect with placement=device (only disk uses it)"),
    (["placement=auto", "placement.host_cache_ratio=0.1"], None,
     "note: placement.host_cache_ratio=0.1 has no effect with placement=auto without placement.host_memory_budget"),
    (["placement=disk", "placement.host_cache_rows=100", "placement.host_cache_ratio=0.1"], None,
     "note: placement.host_cache_ratio=0.1 has no effect with placement.host_cache_rows=100"),
    (["placement=cache", "placement.disk_io_threads=2"], None,
     "note: placement.disk_io_threads=2 has no effect with placement=cache (only disk uses it)"),
    (["placement=lookahead", "placement.sharding=row"], None,
     "note: placement.sharding=row has no effect with one process (trainer.nproc=1): it holds every table"),
    (["precision.rounding=nearest"], None,
     "note: precision.rounding=nearest has no effect with precision=fp32 (only fp16, int8 and int4 rows are rounded)"),
    (["precision.policy=lfu"], None, "note: precision.policy=lfu has no effect with precision=fp32"),
    (["placement=lookahead", "precision=int8", "precision.policy=lfu"], None,
     "note: precision.policy=lfu has no effect with placement=lookahead (every table is behind a placement cache, "
     "which follows placement.policy)"),
    (["optimizer.eps=0.001"], None,
     "note: optimizer.eps=0.001 has no effect with optimizer.name=sgd (only adagrad uses it)"),
    (["optimizer.initial_accumulator=0.1"], None, "note: optimizer.initial_accumulator=0.1 has no effect"),
    (["optimizer.warmup_steps=100"], None,
     "note: optimizer.warmup_steps=100 has no effect with optimizer.schedule=constant (only warmup_poly uses it)"),
    (["optimizer.decay_start_step=10"], None, "note: optimizer.decay_start_step=10 has no effect"),
    (["optimizer.decay_steps=100"], None, "note: optimizer.decay_steps=100 has no effect"),
    (["optimizer.decay_power=1.0"], None, "note: optimizer.decay_power=1.0 has no effect"),
    (["optimizer.min_lr=0.001"], None, "note: optimizer.min_lr=0.001 has no effect"),
    (["model.dcn_layers=2"], None,
     "note: model.dcn_layers=2 has no effect with model.interaction=dot (only dcn uses it)"),
    (["model.dcn_rank=8"], None, "note: model.dcn_rank=8 has no effect with model.interaction=dot"),
    (["placement=lookahead", "trainer.embedding_sync=cache_avg"], None,
     "note: trainer.embedding_sync=cache_avg has no effect with one process (trainer.nproc=1): "
     "there are no replicas to keep in step"),
    (["trainer.sync_every=4"], None, "note: trainer.sync_every=4 has no effect with one process (trainer.nproc=1)"),
    (["trainer.nproc=2", "trainer.sync_every=4"], None,
     "note: trainer.sync_every=4 has no effect with trainer.embedding_sync=grad (only cache_avg uses it)"),
    (["trainer.dist_timeout=30"], None, "note: trainer.dist_timeout=30.0 has no effect with one process"),
    (["trainer.oversubscribe=true"], None, "note: trainer.oversubscribe=true has no effect with one process"),
    (["trainer.early_stop_min_delta=0.01"], None,
     "note: trainer.early_stop_min_delta=0.01 has no effect without trainer.early_stop_patience"),
    (["dataset.path=/data/kaggle", "dataset.cache_dir=/tmp/c"], None,
     "note: dataset.cache_dir=/tmp/c has no effect with dataset.path set"),
    (["dataset.path=/data/kaggle", "dataset.synthetic.rows=2000"], None,
     "note: dataset.synthetic.rows=2000 has no effect with dataset.path set (it describes the built-in synthetic data)"),
    (["dataset.synthetic.session_repeat=0.5"], None,
     "note: dataset.synthetic.session_repeat=0.5 has no effect with dataset.synthetic.sessions=false"),
    (["dataset.synthetic.multi_hot_vocab=50"], None,
     "note: dataset.synthetic.multi_hot_vocab=50 has no effect with dataset.synthetic.multi_hot_features=0"),
    (["dataset.synthetic.profile=terabyte", f"dataset.synthetic.cardinalities=[{','.join(['5'] * 26)}]"], None,
     "note: dataset.synthetic.profile=terabyte has no effect with dataset.synthetic.cardinalities set"),
    # under torchrun trainer.nproc may say 1 while the group has more: the group's size decides
    (["placement=lookahead", "placement.sharding=row"], 2, None),
]


@pytest.mark.parametrize("overrides, processes, note", NOTED, ids=[" ".join(c[0]) for c in NOTED])
def test_an_option_without_effect_gets_its_note(overrides, processes, note):
    notes = no_effect_notes(compose_train(overrides), processes)
    if note is None:
        assert notes == []
    else:
        assert [n for n in notes if n.startswith(note)], notes
        assert len(notes) == 1, notes  # one line per option set, and only for it


@pytest.mark.parametrize("overrides", [
    ["placement=cache", "placement.cache_rows=1000"],  # the same options where they are used
    ["placement=device", "+placement.overrides.C3=lookahead", "placement.cache_ratio=0.1", "placement.window=8"],
    ["placement=lookahead", "placement.device_max_rows=100", "precision=int8", "precision.policy=lfu"],
    ["placement=disk", "placement.disk_path=/tmp", "placement.host_cache_rows=100", "placement.disk_io_threads=2"],
    ["placement=auto", "placement.host_memory_budget=1GiB", "placement.host_cache_ratio=0.1", "placement.window=8"],
    ["placement=lookahead", "placement.sharding=row", "placement.device_memory_budget=1GiB", "trainer.nproc=2"],
    ["placement=lookahead", "trainer.embedding_sync=cache_avg", "trainer.sync_every=4", "trainer.nproc=2",
     "trainer.dist_timeout=30", "trainer.oversubscribe=true"],
    ["precision=int4", "precision.rounding=nearest", "precision.policy=lfu"],
    ["optimizer=adagrad", "optimizer.eps=0.001", "optimizer.schedule=warmup_poly", "optimizer.warmup_steps=100",
     "optimizer.decay_steps=100", "optimizer.min_lr=0.001"],
    ["model.interaction=dcn", "model.dcn_layers=2", "model.bottom_mlp=[64,8]"],
    ["trainer.early_stop_patience=2", "trainer.early_stop_min_delta=0.01"],
    ["dataset.synthetic.rows=2000", "dataset.cache_dir=/tmp/c"],
    ["dataset=synthetic_sessions", "dataset.synthetic.session_repeat=0.5", "dataset.synthetic.multi_hot_vocab=50"],
    ["placement=device", "placement.cache_rows=null", "placement.cache_ratio=0.05"],  # set, but to the default
])
def test_an_option_that_is_used_or_at_its_default_gets_none(overrides):
    assert no_effect_notes(compose_train(overrides)) == []


def test_the_default_config_gets_none():
    assert no_effect_notes(compose_train([])) == []
    assert no_effect_notes(OmegaConf.structured(TrainConfig)) == []


@pytest.mark.parametrize("group, option", group_options())
def test_each_yaml_alone_gets_none(group, option):
    """A config group's own values are the ones its choice uses."""
    assert no_effect_notes(compose_train([option_override(group, option)])) == []


def test_a_rank_other_than_0_says_nothing():
    from recsys_cli.train.run_log import RunLog

    out = io.StringIO()
    console = Console(file=out, width=80)
    RunLog(console, enabled=False).start_line("note: x", console)
    assert out.getvalue() == ""
    RunLog(console, enabled=True).start_line("note: x", console)
    assert out.getvalue() == "note: x\n"


def test_recsys_train_prints_the_note_once_and_trains(tmp_path, capsys, monkeypatch):
    result = train_in_process(["dataset.synthetic.rows=2000", "trainer.max_steps=2", "placement=device",
                               "placement.cache_rows=1000", "optimizer.warmup_steps=5", "hydra.run.dir=run"],
                              cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert result.returncode == 0, result.stderr
    cache_note = ("note: placement.cache_rows=1000 has no effect with placement=device "
                  "(only cache, lookahead and disk use it)")
    schedule_note = ("note: optimizer.warmup_steps=5 has no effect with optimizer.schedule=constant "
                     "(only warmup_poly uses it)")
    lines = result.stdout.splitlines()
    assert lines.count(cache_note) == 1 and lines.count(schedule_note) == 1, result.stdout
    assert lines.index(cache_note) < lines.index(next(line for line in lines if line.startswith("step "))), \
        "a start-up line, before the first step"
    log = (tmp_path / "run" / "app.log").read_text()
    assert len(re.findall(re.escape(cache_note), log)) == 1 and schedule_note in log
    assert (tmp_path / "run" / "summary.json").exists()
