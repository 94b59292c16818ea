# Two commands do all the set-up on a fresh machine:  `make run`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test run clean

install: $(STAMP)

# Torch first from the pinned CPU wheel, so the range in pyproject.toml never pulls a CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

# The suite's files on TEST_WORKERS pytest-xdist workers (each file's tests together, in one
# worker, so a module's server fixture starts once): most of an e2e test's time is waiting on
# its processes, so two workers on two cores take ~0.55x the time of one.
TEST_WORKERS ?= 2

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile tests

run: install
	$(VENV)/bin/tandem serve

clean:
	rm -rf $(VENV)

# The GPU device check in one command (docs/gpu.md): the full run where torch sees a GPU (the
# device tool's machine, no venv there: python3), else the CPU dry run at a tiny size (which
# `make test` also runs, through tests/device/test_gpu_check_dry_run.py). ARGS go to the script.
.PHONY: gpu-check device-wheels
gpu-check:
	bash tests/device/gpu_check.sh $(ARGS)

# What the GPU machine lacks, into .device/ (git-ignored) for the device tool's carry.
device-wheels: install
	PYTHON=$(PY) bash tests/device/device_wheels.sh
