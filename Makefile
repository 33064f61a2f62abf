# make demo  : the main job: `neuronlocal check` (does the embedded Llama config run on Trainium?);
#              sets up only what it needs (requirements.txt: torch==2.13.0 CPU, transformers)
# make setup : everything for tests and integrations (requirements-dev.txt)
# make test  : the default test run (CI runs the same command)
# make lock  : rewrite the lock (constraints.txt) from the newest releases, then make test
# make test-latest : the default suite on the newest releases in a throwaway venv (not gating)
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: setup demo test test-slow test-latest lock lint typecheck bench

setup: $(VENV)/.dev-installed

# The core: the demo's packages, then the C++ build against the pinned torch.
$(BIN)/neuronlocal: pyproject.toml setup.py constraints.txt requirements.txt $(wildcard src/neuronlocal/csrc/*)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(BIN)/pip install -q -c constraints.txt --no-build-isolation -e .
	touch $@

$(VENV)/.dev-installed: $(BIN)/neuronlocal requirements-dev.txt
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $@

demo: $(BIN)/neuronlocal
	$(BIN)/neuronlocal info
	$(BIN)/neuronlocal check

test: setup
	$(BIN)/python -m pytest -m "not slow" -q

test-slow: setup
	$(BIN)/python -m pytest -m slow -q

test-latest: setup
	$(BIN)/python tools/lock.py latest

lock: setup
	$(BIN)/python tools/lock.py update
	$(MAKE) test

# ruff on the whole tree, then mypy on src/ (settings in pyproject.toml). CI runs both.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

typecheck: setup
	$(BIN)/mypy

bench: setup
	$(BIN)/python bench/eager.py
