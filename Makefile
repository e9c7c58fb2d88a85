# Two entry points that work on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) scripts/patch_torchvision.py
	touch $(STAMP)

.PHONY: setup serve test lint bench
setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/mmserve serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts
