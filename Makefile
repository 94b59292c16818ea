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

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q tests

run: install
	$(VENV)/bin/tandem serve

clean:
	rm -rf $(VENV)
