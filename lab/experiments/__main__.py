"""`python -m lab.experiments [ch01 ...]`: run chapters' experiments in full (or quick with LAB_QUICK=1)."""

import sys
import time

from ..results import quick, results_path
from . import CHAPTERS, chapter

if __name__ == "__main__":
    names = sys.argv[1:] or list(CHAPTERS)
    for name in names:
        t0 = time.perf_counter()
        print(f"== {name} ({'quick' if quick() else 'full'}) -> {results_path()}", flush=True)
        chapter(name).run()
        print(f"== {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
