"""Timing: warm-up excluded, repeated, median and spread reported, threads stated."""

import statistics
import time

import torch


def time_call(fn, warmup: int = 2, reps: int = 7, min_seconds: float = 0.0) -> dict:
    """Run fn() `warmup` times untimed, then at least `reps` times (and at least `min_seconds` in all).

    Returns seconds: median, min, max, interquartile range, the count, and the torch thread count.
    """
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        times, start = [], time.perf_counter()
        while len(times) < reps or time.perf_counter() - start < min_seconds:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return dict(median=statistics.median(times), min=min(times), max=max(times), iqr=q[2] - q[0],
                n=len(times), threads=torch.get_num_threads())
