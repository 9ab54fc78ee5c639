# Spillway: `make demo` runs the platform locally, `make test` runs every check.
# Both create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODELS ?= models
export SPILLWAY_MODELS_DIR := $(abspath $(MODELS))

.PHONY: setup models lint test demo clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements/dev.txt requirements/export.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/dev.txt -r requirements/export.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

models: $(MODELS)/.built

$(MODELS)/.built: $(STAMP) $(wildcard spillway_cli/modelbuild/*.py)
	$(BIN)/spillway models build --out $(MODELS)
	touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy spillway spillway_cli tests

test: setup models lint
	$(BIN)/pytest

demo: setup models
	$(BIN)/spillway demo --repository $(MODELS)

clean:
	rm -rf $(MODELS) .pytest_cache .mypy_cache .ruff_cache .hypothesis
