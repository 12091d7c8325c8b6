# One venv per checkout. torch is installed first and pinned so the rest
# resolves against the CPU build that lies on the machine's disk.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup train test docs verify chaos bench bench-soak bench-headline bench-peers peers-setup gpu-wheels gpu-env gpu-check gpu-check-dry clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

train: setup
	$(BIN)/recsys train $(ARGS)

# The type check (mypy, configured in pyproject.toml; incremental, its cache
# in .mypy_cache) and the suite; ARGS go to pytest. The suite runs its test
# files on TEST_WORKERS pytest-xdist workers (--dist loadfile: a file's tests,
# and so its module-scoped runs and datasets, stay on one worker): most tests
# run one process at a time, and two workers on 2 cores took the suite from
# 614 to 399 s (docs/development.md, Testing). TEST_WORKERS=0 runs it in one
# process. mypy runs beside pytest, its report printed after the suite's.
# Either failing fails the target. The package is byte-compiled first: the
# editable install leaves recsys_cli without .pyc files, and where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines) each of the
# suite's ~180 processes compiled it again from source (0.1-0.2 s of CPU each);
# compileall writes them anyway, and only for files that changed.
TEST_WORKERS ?= 2
test: setup
	@$(BIN)/python -m compileall -q recsys_cli data_tools > /dev/null
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile $(ARGS); tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 -a $$typed -eq 0

# The long matrix (docs/development.md, Testing): 300 differential combinations and the
# fuzzed parser with 20,000 new examples a test (tests/test_parser_fuzz.py),
# then every test marked `verify` (the command-line reproducibility and
# kill/resume checks of every combination, and the rest that `make test` keeps
# one fast case of).
# The generated reference pages (docs/reference/config.md, commands.md) from
# the schema and the commands' --help; tests/test_docs.py fails when the
# committed pages differ from what this writes.
docs: setup
	$(BIN)/python -m recsys_cli.reference_docs

verify: setup
	RECSYS_VERIFY=1 RECSYS_DIFF_COMBOS=300 $(BIN)/pytest tests/test_differential.py tests/test_parser_fuzz.py $(ARGS)
	RECSYS_VERIFY=1 $(BIN)/pytest -m verify $(ARGS)

# The chaos soak (BENCHMARKS.md, "Chaos soak"): one run through 20 random
# faults (kill -9 anywhere, in checkpoint writes and evaluations, SIGTERM, a
# killed rank, a full disk) resumed after each, one process and two; the final
# checkpoint against the uninterrupted run's. Root for the full disk (a tmpfs);
# ARGS=--no-full-disk without it, ARGS='--scenario single --record' etc.
chaos: setup
	$(BIN)/python -m bench.chaos_soak $(ARGS)

# The standard set of benchmarks (bench/README.md), each appending its rows to
# BENCHMARKS.md: about 7 minutes on 2 idle cores (6 min 59 s timed on
# 2026-12-05: up to 10 minutes of time shares, each benchmark's rounds stopping
# when its share is spent or its rounds are done, plus set-up: data, tables,
# the predict benchmark's Kaggle-sized checkpoint). ARGS picks: `make bench ARGS=train`, `ARGS="threads --size
# kaggle2048"`, `ARGS="train --size smoke"` (smoke sizes print, never record);
# `ARGS=--list` lists the set, its sizes and time shares.
bench: setup
	$(BIN)/python -m bench --record $(ARGS)

# Memory that does not grow with the run: peak RSS at many steps vs few, each
# in its own process (bench/soak_bench.py; a few minutes at its defaults).
bench-soak: setup
	$(BIN)/python -m bench.soak_bench $(ARGS)

# The full-scale run of BENCHMARKS.md's headline section: a Kaggle-sized raw
# TSV (about 12 GB, generated) -> preprocess -> one epoch fp32 and int4 +
# lookahead; about an hour of a 2-core machine, ~40 GB of free disk in /tmp.
bench-headline: setup
	$(BIN)/python -m bench.headline --record $(ARGS)

# The device check (docs/how-to/gpu.md): tests on CUDA, exactness and determinism on
# CUDA, placement timings and prefetch overlap; one CUDA GPU, ~4 minutes.
# It runs in its own venv on the machine's torch (PYTHON: the Python whose
# torch is built for its CUDA, >= 2.11), installed offline from wheels/, which
# `make gpu-wheels` fills where there is network (tools/gpu_env.py).
PYTHON ?= python3
GPU_VENV ?= .venv-gpu
WHEELS ?= wheels
WHEEL_TOOLS := .venv-wheels
# PyYAML's compiled wheels are fetched for each (0.8 MB each): narrow these to
# the box's Python and platform for a smaller folder.
GPU_PYTHONS ?= 3.10,3.11,3.12,3.13,3.14
GPU_PLATFORMS ?= manylinux2014_x86_64,manylinux2014_aarch64

gpu-wheels:
	$(PY) -m venv $(WHEEL_TOOLS)
	$(WHEEL_TOOLS)/bin/python tools/gpu_env.py wheels --dir $(WHEELS) --python-versions $(GPU_PYTHONS) --platforms $(GPU_PLATFORMS)

gpu-env:
	$(PYTHON) tools/gpu_env.py install --venv $(GPU_VENV) --wheels $(WHEELS)

gpu-check: gpu-env
	$(GPU_VENV)/bin/python -m bench.gpu_check $(ARGS)

# The same check with every stage on CPU at tiny sizes (tests/test_gpu_env.py runs it:
# two stages in `make test`, every stage in `make verify`).
gpu-check-dry: gpu-env
	$(GPU_VENV)/bin/python -m bench.gpu_check --dry $(ARGS)

# The peer benchmark (BENCHMARKS.md, "Peers"): recsys against FBGEMM's TBE +
# TorchRec's DLRM dense arch and plain nn.EmbeddingBag, in one process. Its
# own venv, so the project's never depends on fbgemm or torchrec: torch first,
# then fbgemm-gpu-cpu and torchrec at the versions built against it (1.8.0 of
# both for torch 2.13.0; torchrec without its deps, which would move torch),
# every install held at the same torch.
PEERS := .venv-peers
PEERS_BIN := $(PEERS)/bin
FBGEMM ?= fbgemm-gpu-cpu==1.8.0
TORCHREC ?= torchrec==1.8.0
PEERS_STAMP := $(PEERS)/.installed

peers-setup: $(PEERS_STAMP)

$(PEERS_STAMP): pyproject.toml
	$(PY) -m venv $(PEERS)
	$(PEERS_BIN)/pip install -q --upgrade pip
	$(PEERS_BIN)/pip install -q "$(TORCH)"
	$(PEERS_BIN)/pip install -q "$(FBGEMM)" "$(TORCH)"
	$(PEERS_BIN)/pip install -q --no-deps "$(TORCHREC)"
	$(PEERS_BIN)/pip install -q tensordict torchmetrics==1.0.3 pyre-extensions iopath "$(TORCH)"
	$(PEERS_BIN)/pip install -q -e . "$(TORCH)"
	touch $(PEERS_STAMP)

bench-peers: peers-setup
	$(PEERS_BIN)/python -m bench.peers.ab $(ARGS)

clean:
	rm -rf $(VENV) $(PEERS) $(GPU_VENV) $(WHEEL_TOOLS) outputs multirun .pytest_cache .mypy_cache
