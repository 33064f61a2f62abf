# make setup : create .venv with torch==2.13.0 (CPU, pinned) and build neuronlocal
# make demo  : the main job: `neuronlocal check` (does the embedded Llama config run on Trainium?)
# make test  : the default test run (CI runs the same command)
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: setup demo test test-slow lint typecheck bench

setup: $(BIN)/neuronlocal

$(BIN)/neuronlocal: pyproject.toml setup.py constraints.txt requirements-dev.txt $(wildcard src/neuronlocal/csrc/*)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -r requirements-dev.txt
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(BIN)/pip install -q -c constraints.txt --no-build-isolation -e .
	touch $@

demo: setup
	$(BIN)/neuronlocal info
	$(BIN)/neuronlocal check

test: setup
	$(BIN)/python -m pytest -m "not slow" -q

test-slow: setup
	$(BIN)/python -m pytest -m slow -q

# ruff on the whole tree, then mypy on src/ (settings in pyproject.toml). CI runs both.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

typecheck: setup
	$(BIN)/mypy

bench: setup
	$(BIN)/python bench/eager.py
