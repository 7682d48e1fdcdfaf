"""`python -m lab.experiments [ch01 ...]`: run chapters' experiments.

Quick mode by default (short sweeps, a temporary results file); LAB_FULL=1 (as `make results` sets it)
runs the full sweeps and writes results/results.json and results/figures/.
"""

import sys
import time

from ..results import quick, require_clean, results_path
from . import CHAPTERS, run

if __name__ == "__main__":
    require_clean()
    for name in sys.argv[1:] or list(CHAPTERS):
        t0 = time.perf_counter()  # the chapter's wall time, measured once: a progress message, not a result
        print(f"== {name} ({'quick' if quick() else 'full'}) -> {results_path()}", flush=True)
        run(name)
        print(f"== {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
