"""One module per chapter: the measurements that fill results.json (`python -m lab.experiments [chNN ...]`).

Besides the chapters: gpu.py (every CUDA measurement), notebooks.py (each notebook's running time in quick
mode), plots.py (figure size and legibility for the book's column).
"""

from importlib import import_module

CHAPTERS = {"ch01": "ch01_recompute", "ch02": "ch02_build", "ch03": "ch03_savings",
            "ch04": "ch04_identity", "ch05": "ch05_paged"}


def chapter(name: str):
    if name not in CHAPTERS:
        raise ValueError(f"unknown chapter {name!r}; chapters: {', '.join(CHAPTERS)}")
    return import_module(f"{__name__}.{CHAPTERS[name]}")
