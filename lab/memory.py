"""Peak extra memory of a KV cache while decoding, measured for real in a fresh process.

`probe` starts `python -m lab.memory ...` and reads the one JSON line it prints. A fresh
process per measurement matters: memory a previous run freed is often not given back to the operating
system, so it would hide (or inflate) the next run's growth.

The child loads the model, runs a short throwaway generation first (torch allocates its thread pools,
kernels' scratch space and the allocator's first arenas lazily, on first use), collects garbage, asks
glibc to return its free heap memory (malloc_trim), and only then records the baseline. It then builds
the cache, prefills a random prompt and decodes one token at a time, feeding the argmax, until `tokens`
positions are cached; after every step it samples the process's resident set size (RSS).
`peak_extra_bytes` = the highest sample - the baseline.

What RSS shows, and what it does not:
- RSS counts pages the process has touched and not given back: the cache's tensors, but also the
  activations of the step in flight, and freed memory the C allocator keeps for reuse. glibc's malloc
  serves small blocks from arenas it rarely shrinks, and large ones (above a threshold that itself grows
  after the first large free, up to 32 MiB) from mmap, which is returned at once. ConcatCache frees a
  slightly smaller tensor on every step; whether that memory goes back to the system or lingers as holes
  depends on those rules, which is exactly what the measurement exposes. Without the malloc_trim before
  the baseline, the heap still holds megabytes freed while the model was built, already counted in the
  baseline RSS; a growing cache of small tensors reuses them and seems to cost almost nothing
  (gpt2-random, batch 1: 5.6 MiB of RSS growth for a 67.5 MiB ConcatCache).
- Samples are taken between steps, so a peak inside one step (torch.cat briefly holds the old and the new
  tensor of one layer) can be missed. `ru_maxrss` is the kernel's own lifetime peak and misses nothing,
  but it covers model loading too; `ru_maxrss_extra` is given only when the run set a new lifetime peak.
- The CPU has no "reserved" counter: reserved-but-unused memory is a concept of PyTorch's CUDA caching
  allocator. On CUDA the child also reports max_memory_allocated (live tensors) and max_memory_reserved
  (blocks the caching allocator holds) above their baselines; the gap between the two is where the
  concatenating design's fragmentation shows.
"""

import argparse
import ctypes
import gc
import itertools
import json
import os
import resource
import subprocess
import sys
import time

import torch
from tqdm.auto import tqdm

from .bench import sync
from .cache import cache_bytes, make_cache
from .models import forward_cached, load
from .results import REPO_ROOT

MiB = 2**20


def decode_until(model, cache, prompt_ids, tokens, on_step=None):
    """Prefill `prompt_ids` [B, P], then decode greedily until the cache holds `tokens` positions."""
    w, cfg = model.weights, model.config
    logits = forward_cached(prompt_ids, w, cfg, cache, last_only=True)  # [B, 1, V]
    if on_step:
        on_step()
    while cache.length < tokens:
        next_ids = logits[:, -1].argmax(-1, keepdim=True)                # [B, 1]
        logits = forward_cached(next_ids, w, cfg, cache, last_only=True)
        if on_step:
            on_step()


def release_free_memory() -> bool:
    """Hand the C heap's free memory back to the OS (glibc's malloc_trim), so RSS counts live memory only."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):  # not glibc (macOS, musl): the baseline keeps the allocator's free lists
        return False


@torch.inference_mode()
def measure(model_name, design, batch_size, tokens, prompt=16, device="cpu", seed=0) -> dict:
    """The child's measurement (run it in a fresh process: see `probe`)."""
    import psutil

    if tokens <= prompt:
        raise ValueError(f"tokens ({tokens}) must exceed the prompt ({prompt}): at least one decode step")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but torch.cuda.is_available() is False on this machine")
    model = load(model_name).to(device)
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, prompt), generator=g).to(device)  # [B, P]

    # warm-up on a throwaway cache of the same design, so torch's lazy first-use allocations are in the baseline
    decode_until(model, make_cache(design, cfg, prompt + 4, batch_size, device=device), ids, prompt + 4)
    sync(device)
    gc.collect()
    trimmed = release_free_memory()

    proc = psutil.Process()
    baseline_rss = peak_rss = proc.memory_info().rss
    ru_baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    if device.type == "cuda":
        base_alloc, base_reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)

    def on_step():
        nonlocal peak_rss
        peak_rss = max(peak_rss, proc.memory_info().rss)

    t0 = time.perf_counter()  # the run's wall time, read once for the record (this probe measures memory)
    cache = make_cache(design, cfg, tokens, batch_size, device=device)
    on_step()  # a static cache's whole buffer exists from here on
    decode_until(model, cache, ids, tokens, on_step)
    sync(device)
    seconds = time.perf_counter() - t0

    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = dict(model=model_name, design=design, batch_size=batch_size, tokens=tokens, prompt=prompt,
               device=str(device), length=cache.length, baseline_rss=baseline_rss, peak_rss=peak_rss,
               peak_extra_bytes=peak_rss - baseline_rss, ru_maxrss=ru_maxrss,
               ru_maxrss_extra=ru_maxrss - baseline_rss if ru_maxrss > ru_baseline else None,
               cache_bytes=cache_bytes(cfg, tokens, batch_size), final_nbytes=cache.nbytes(),
               seconds=seconds, threads=torch.get_num_threads(), trimmed=trimmed)
    if device.type == "cuda":
        out |= dict(cuda_peak_allocated_extra=torch.cuda.max_memory_allocated(device) - base_alloc,
                    cuda_peak_reserved_extra=torch.cuda.max_memory_reserved(device) - base_reserved)
    return out


def probe(model_name, design, batch_size, tokens, prompt=16, device="cpu", timeout=1800) -> dict:
    """Measure one (model, design, batch, tokens) in a fresh Python process; returns the child's dict."""
    cmd = [sys.executable, "-m", "lab.memory", "--model", model_name, "--design", design,
           "--batch", str(batch_size), "--tokens", str(tokens), "--prompt", str(prompt), "--device", device]
    # the same environment (LAB_CACHE, thread settings); run from the repository root so `-m` finds `lab`
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), cwd=REPO_ROOT, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed ({' '.join(cmd[1:])}):\n{done.stderr.strip()[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"memory probe printed no JSON line; stdout was:\n{done.stdout[-2000:]}")
    return json.loads(lines[-1])


def sweep(models=("gpt2-random", "smollm2"), designs=("concat", "static"), batches=(1, 8), tokens=960,
          device="cpu", progress=True) -> list[dict]:
    """probe() for every (model, batch, design): one fresh process each."""
    combos = list(itertools.product(models, batches, designs))
    rows = []
    for model_name, batch_size, design in tqdm(combos, desc="cache memory", disable=not progress):
        rows.append(probe(model_name, design, batch_size, tokens, device=device))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="Peak extra memory of one KV cache run; prints one JSON line.")
    p.add_argument("--model", required=True)
    p.add_argument("--design", choices=("concat", "static"), required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    print(json.dumps(measure(a.model, a.design, a.batch, a.tokens, a.prompt, a.device)), flush=True)


if __name__ == "__main__":
    main()
