# One venv per checkout. torch is installed first and pinned so the rest
# resolves against the CPU build that lies on the machine's disk.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup train test verify bench bench-soak gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

train: setup
	$(BIN)/recsys train $(ARGS)

test: setup
	$(BIN)/pytest $(ARGS)

# The long matrix (README, Testing): 300 differential combinations and the
# command-line reproducibility and kill/resume checks of every combination.
verify: setup
	RECSYS_VERIFY=1 RECSYS_DIFF_COMBOS=300 $(BIN)/pytest tests/test_differential.py tests/test_resume_exact.py $(ARGS)

bench: setup
	$(BIN)/python -m bench.run_all $(ARGS)

# Memory that does not grow with the run: peak RSS at many steps vs few, each
# in its own process (bench/soak_bench.py; a few minutes at its defaults).
bench-soak: setup
	$(BIN)/python -m bench.soak_bench $(ARGS)

# The device check (README, GPU): tests on CUDA, exactness and determinism on
# CUDA, placement timings and prefetch overlap; needs one CUDA GPU, ~8 minutes.
gpu-check: setup
	$(BIN)/python -m bench.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
