"""Timing: warm-up excluded, repeated, median and spread reported, threads stated. On CUDA, `device_times`
times calls between CUDA events, so that the host never waits between them."""

import statistics
import time

import torch


def sync(device="cpu"):
    """Wait for the device's queued work (CUDA kernels run asynchronously): call before reading a clock."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def summarize(times: list, samples: bool = False) -> dict:
    """Median, min, max, interquartile range and count of a list of seconds, with the thread count
    (and the list itself as "samples" when asked, e.g. to pair the rounds of two functions)."""
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    out = dict(median=statistics.median(times), min=min(times), max=max(times), iqr=q[2] - q[0],
               n=len(times), threads=torch.get_num_threads())
    return out | {"samples": list(times)} if samples else out


def ratio_summary(num: list, den: list) -> dict:
    """num[i] / den[i] for each round i (two functions' seconds from the same rounds, e.g. time_rounds'
    samples): median, min, max, quartiles, interquartile range and count."""
    r = [a / b for a, b in zip(num, den, strict=True)]
    q1, _, q3 = statistics.quantiles(r, n=4) if len(r) >= 2 else [r[0]] * 3
    return dict(median=statistics.median(r), min=min(r), max=max(r), q1=q1, q3=q3, iqr=q3 - q1, n=len(r))


def time_call(fn, warmup: int = 2, reps: int = 7, min_seconds: float = 0.0, device="cpu") -> dict:
    """Run fn() `warmup` times untimed, then at least `reps` times (and at least `min_seconds` in all)."""
    return time_steps(lambda: None, fn, warmup, reps, min_seconds, device)


_L2_FLUSH = {}


def device_times(fn, warmup, reps, device) -> dict:
    """Seconds per call of fn (summarize's dict). On CUDA: `warmup` calls, then `reps` calls, each between
    two CUDA events with the L2 cache flushed (256 MiB written) before it, and one synchronize at the end:
    the host never waits between calls. On the CPU: time_call."""
    if torch.device(device).type != "cuda":
        return time_call(fn, warmup, reps, device=device)
    if device not in _L2_FLUSH:
        _L2_FLUSH[device] = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        _L2_FLUSH[device].zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return summarize([start.elapsed_time(end) / 1e3 for start, end in events])      # elapsed_time: ms


def time_steps(setup, step, warmup: int = 2, reps: int = 7, min_seconds: float = 0.0, device="cpu") -> dict:
    """Time step() only; setup() runs untimed before every call (e.g. to crop a cache back to its length)."""
    with torch.inference_mode():
        for _ in range(warmup):
            setup()
            step()
        times, start = [], time.perf_counter()
        while len(times) < reps or time.perf_counter() - start < min_seconds:
            setup()
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - t0)
    return summarize(times)


def time_rounds(fns: dict, warmup: int = 2, rounds: int = 9, setup=None, device="cpu", samples=False) -> dict:
    """Time several functions in rounds (each once per round, in turn), so that a slow spell of a shared
    machine hits all of them alike rather than one block of repetitions. setup(), if given, runs untimed
    before every call, warm-up included (e.g. flush_caches, or cropping a cache back to its length).
    {name: summary} in fns' order; with samples=True each summary keeps its list of seconds, round by
    round, so that the i-th samples of two functions come from the same round."""
    times = {name: [] for name in fns}
    with torch.inference_mode():
        for _ in range(warmup):
            for fn in fns.values():
                if setup is not None:
                    setup()
                fn()
        for _ in range(rounds):
            for name, fn in fns.items():
                if setup is not None:
                    setup()
                sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                times[name].append(time.perf_counter() - t0)
    return {name: summarize(t, samples) for name, t in times.items()}


_FLUSH = {}


def flush_caches(nbytes: int = 128 * 2**20) -> None:
    """Write nbytes of scratch memory, evicting everything else from the CPU's caches (128 MiB by default,
    more than the last-level cache of most CPUs), so the next call reads its inputs from main memory.
    The scratch buffer is allocated once per size and kept, so the flush itself never page-faults."""
    if nbytes not in _FLUSH:
        _FLUSH[nbytes] = torch.empty(nbytes // 4, dtype=torch.float32)
    _FLUSH[nbytes].fill_(1.0)
