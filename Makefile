# Two entry points for a fresh machine: `make train` and `make test`.
# Each creates .venv on first use. TORCH picks the torch build installed into a
# fresh venv (here: the CPU build); a venv that already has torch keeps it.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# Test modules run side by side in this many pytest-xdist workers, a module per worker (its fixtures once);
# many multi-process tests spend their time waiting on ranks (bench/loaded_suite.py --workers is the same).
WORKERS ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.flodl-installed

.PHONY: train test lint gpu-test clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --max-worker-restart=0 $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean-venv:
	rm -rf $(VENV)
