# Two commands: `make test` and `make results`. Every target installs what it needs and is idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
READY := $(VENV)/.ready-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
NOTEBOOKS := $(wildcard notebooks/ch*.py)

.PHONY: setup test results lab book notebooks lint clean

setup: $(READY)
	@$(PY) -m lab.prepare

# torch first and by exact version: the CPU build on this disk, never a multi-GB CUDA download.
$(READY): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	rm -f $(VENV)/.ready-* && touch $@

lint: setup
	$(VENV)/bin/ruff check lab tests notebooks

notebooks: setup
	@mkdir -p build/notebooks
	@for nb in $(NOTEBOOKS); do \
	  $(VENV)/bin/jupytext --quiet --to ipynb --set-kernel python3 -o build/notebooks/$$(basename $$nb .py).ipynb $$nb \
	  || exit 1; done

# Quick mode: shorter sweeps, results written to a temporary file, never to results/results.json.
test: lint notebooks
	LAB_QUICK=1 $(VENV)/bin/pytest
	LAB_QUICK=1 $(VENV)/bin/pytest --nbval-lax -p no:cacheprovider build/notebooks

results: setup
	$(PY) -m lab.experiments
	$(PY) -m lab.experiments.gpu
	$(PY) -m lab.readme
	$(MAKE) book

book: setup
	$(PY) -m lab.book

lab: setup
	$(PIP) -e '.[lab]'
	cd notebooks && ../$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) \
	  --ServerApp.contents_manager_class=jupytext.TextFileContentsManager

clean:
	rm -rf build .pytest_cache
