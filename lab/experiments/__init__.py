"""One module per chapter: the measurements that fill results.json (`python -m lab.experiments [chNN ...]`).

Each chapter module has `measure(quick_mode=None)` (every measurement, as plain Python values) and
`record(m)` (write them and the figures to results.json); a notebook calls its parts one at a time, and
`run` calls both. Besides the chapters: gpu.py (every CUDA measurement), notebooks.py (each notebook's
running time in quick mode), plots.py (figure size and legibility for the book's column), tables.py (how a
notebook shows a table: units, separators, significant digits, words for booleans).

A measurement a reader could reuse lives in the library, not here: lab.metrics (teacher-forced quality
through any cache, ROC AUC, key spread), lab.step_cost (what a decode step costs), lab.identity_cost
(what checking a cache's identity costs), lab.updates (weight updates as training makes them),
lab.models.retrofit (the same function with outlier key channels), lab.memory (peak memory in a fresh
process), lab.contention (a step on a busy machine), lab.workloads (synthetic prefix-sharing workloads and
their hit rates), lab.loadgen (the HTTP load and the two-server comparison), and lab.peers (transformers,
kvpress and vLLM run beside the lab).
"""

from importlib import import_module

from ..results import start_clock

CHAPTERS = {"ch01": "ch01_recompute", "ch02": "ch02_build", "ch03": "ch03_savings",
            "ch04": "ch04_identity", "ch05": "ch05_paged", "ch06": "ch06_prefix",
            "ch07": "ch07_compress", "ch08": "ch08_serving", "ch09": "ch09_speculation",
            "ch10": "ch10_architecture", "ch11": "ch11_beyond", "ch12": "ch12_branches"}


def chapter(name: str):
    """The module of a chapter: chapter("ch02") is lab.experiments.ch02_build."""
    if name not in CHAPTERS:
        raise ValueError(f"unknown chapter {name!r}; chapters: {', '.join(CHAPTERS)}")
    return import_module(f"{__name__}.{CHAPTERS[name]}")


def run(name_or_module, quick_mode=None) -> dict:
    """Measure a chapter and record it in results.json (a temporary file in quick mode); returns the
    measurements. `run("ch02")` is `python -m lab.experiments ch02`."""
    module = chapter(name_or_module) if isinstance(name_or_module, str) else name_or_module
    start_clock()
    m = module.measure(quick_mode)
    module.record(m)
    return m
