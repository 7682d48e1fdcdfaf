"""A decode step on a busy machine: torch's OpenMP defaults against the lab's setting (lab/threads.py).

`compare` times one cached SmolLM2 decode step in fresh processes, one per (setting, load): OpenMP reads
its settings once, when torch loads, so a setting can only be tried in a process of its own. Each worker
(`python -m lab.contention`) loads the model, prefills `context` positions into a StaticCache and
times `reps` decode steps after a warm-up (lab.bench.time_steps, the cache cropped back before each); it
prints one JSON line. The load is `hogs` other torch programs, started before the worker and stopped after
it, each running small operators in a loop on torch's default threads with OpenMP's defaults, as a second
notebook, a test run or a server on the reader's laptop would. The cases run in rounds, every (setting,
load) once per round, so that a slow spell of a shared machine falls on all of them, and the median over
rounds is kept.

A timing benchmark, not a test: its numbers go to results.json (chapter 3), never into an assertion.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from tqdm.auto import tqdm

from . import threads
from .results import REPO_ROOT

# The settings compared: OpenMP's own defaults (threads spin ~300,000 turns before sleeping), the lab's
# (threads.SETTINGS), a short spin, and one thread (no team to wait for).
SETTINGS = {
    "default": {},
    "lab": dict(threads.SETTINGS),
    "short_spin": {"GOMP_SPINCOUNT": "10000"},
    "one_thread": {"OMP_NUM_THREADS": "1"},
}
# Another torch program: small products and activations in a loop, on torch's default threads.
HOG = ("import torch\n"
       "a = torch.randn(64, 64)\n"
       "while True:\n"
       "    a = torch.tanh(a @ a)\n")


def environment(setting: dict) -> dict:
    """This process's environment with the OpenMP keys replaced by `setting` alone (LAB_OMP_DEFAULT=1, so
    that `import lab` in the worker leaves them as given)."""
    env = {k: v for k, v in os.environ.items() if k not in threads.KEYS}
    return env | {"LAB_OMP_DEFAULT": "1"} | setting


def worker(setting: dict, context: int, reps: int, warmup: int = 3, timeout=600) -> dict:
    """One decode-step timing in a fresh process with OpenMP `setting`; the worker's JSON line."""
    cmd = [sys.executable, "-m", "lab.contention", "--context", str(context), "--reps", str(reps),
           "--warmup", str(warmup)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=environment(setting), cwd=REPO_ROOT,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"load worker failed ({setting}):\n{done.stderr.strip()[-2000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


class Hogs:
    """`n` other torch programs busy on the CPU while inside (n = 0: an idle machine), with OpenMP's defaults."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", HOG], env=environment({}))
                      for _ in range(self.n)]
        time.sleep(1.0 if self.n else 0)  # let them load torch and start their loops
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def loads_for(cpus=None) -> tuple:
    """The loads compared: an idle machine, one other torch program, and two for every core."""
    cpus = cpus or os.cpu_count()
    return 0, 1, 2 * cpus


def compare(settings=None, loads=None, rounds=3, context=256, reps=15, warmup=3, progress=True) -> dict:
    """{setting: {hogs: {"median": s, "rounds": [s, ...], "threads": n}}}: the median decode step of each
    setting with each number of competing torch programs (default: loads_for())."""
    settings = settings or SETTINGS
    loads = loads if loads is not None else loads_for()
    runs = {name: {n: [] for n in loads} for name in settings}
    threads_used = {}
    cases = [(name, n) for _ in range(rounds) for n in loads for name in settings]
    for name, n in tqdm(cases, desc="decode step under load", disable=not progress):
        with Hogs(n):
            r = worker(settings[name], context, reps, warmup)
        runs[name][n].append(r["median"])
        threads_used[name] = r["threads"]
    return {name: {n: dict(median=statistics.median(ts), rounds=ts, threads=threads_used[name])
                   for n, ts in by_load.items()} for name, by_load in runs.items()}


def measure_step(context: int, reps: int, warmup: int = 3) -> dict:
    """In the worker: the median of `reps` SmolLM2 decode steps after `context` cached positions."""
    import torch

    from .bench import time_steps
    from .cache import StaticCache
    from .models import forward_cached, load

    model = load("smollm2")
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(model.config, context + 1)
    with torch.inference_mode():
        forward_cached(ids[:, :context], model.weights, model.config, cache)            # prefill, untimed
    r = time_steps(lambda: cache.crop(context),
                   lambda: forward_cached(ids[:, context:], model.weights, model.config, cache), warmup, reps)
    return dict(median=r["median"], iqr=r["iqr"], threads=r["threads"],
                openmp={k: os.environ[k] for k in threads.KEYS if k in os.environ})


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Time one SmolLM2 decode step; print one JSON line.")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    print(json.dumps(measure_step(a.context, a.reps, a.warmup)), flush=True)
