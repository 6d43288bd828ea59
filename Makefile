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
CONFIG ?= tiny
PYTEST_ARGS ?=

BIN := $(VENV)/bin
# DeepSpeed JIT-builds C++ ops once per machine; keeping them beside the venv
# stops a different ninja on PATH from forcing a rebuild every run.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: setup pipeline validate plan status test test-slurm docs clean help

help:
	@echo "make pipeline [CONFIG=tiny]   run a pipeline (default: the tiny chain, locally on CPU)"
	@echo "make test                     run the test suite"
	@echo "make test-slurm               run the Slurm suite on a throw-away local cluster (root, Debian)"
	@echo "make validate CONFIG=...      check a pipeline file, its models and data"
	@echo "make plan CONFIG=...          will each stage fit its GPUs, how long will it take"
	@echo "make status CONFIG=...        show each stage's state"
	@echo "make setup                    create $(VENV) with the pinned stack ($(STACK))"

setup: $(VENV)/.installed-$(STACK)

$(VENV)/.installed-$(STACK): $(REQUIREMENTS) pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(BIN)/pip install --quiet -r $(REQUIREMENTS) --constraint $(VENV)/torch-constraint.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

pipeline: setup
	$(BIN)/python -m pipeline run $(CONFIG)

validate: setup
	$(BIN)/python -m pipeline validate $(CONFIG)

plan: setup
	$(BIN)/python -m pipeline plan $(CONFIG)

status: setup
	$(BIN)/python -m pipeline status $(CONFIG)

test: setup
	$(BIN)/python tests/prebuild_deepspeed_ops.py
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests

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

docs: setup
	$(BIN)/python -m pipeline.docs
