# Two entry points, both doing all set-up on a fresh machine: `make demo` and `make test`.
# The virtual environment gets torch's CPU build from this machine's disk (torch==2.13.0);
# a bare `torch` from the registry would be a CUDA build of several GB.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ftstate-installed

.PHONY: demo test lint install-check mutation-check setup clean docs

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0" -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/ftstate demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check ftstate tests benchmarks

# What a user's `pip install torch==2.13.0 ftstate` gets: the wheel with only its declared
# dependencies, in a fresh venv outside the checkout (names, a real sync, demo, CLI; ~2 min).
install-check: $(STAMP)
	PY=$(PY) PIP=$(abspath $(BIN))/pip bash tests/install/check_plain_install.sh

# Each core claim broken in turn in a scratch copy; the tests named for it must fail (~3 min).
mutation-check: $(STAMP)
	$(BIN)/python tests/mutation/check_mutations.py

# Two pytest sessions: a driver joins one Ray cluster only, and tests/multinode runs its own
# (3 raylets on 127.0.0.1, ~10 s to start). ARGS goes to the first, MULTINODE_ARGS to the second.
test: $(STAMP) lint install-check
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/pytest -q --ignore=tests/multinode $(ARGS)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/pytest -q tests/multinode $(MULTINODE_ARGS)
	$(MAKE) mutation-check

docs: $(STAMP)
	$(BIN)/python -m ftstate.cli.docs

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
