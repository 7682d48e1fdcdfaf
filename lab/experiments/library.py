"""The lab's cached decode against transformers' own `generate`: same weights, same ids, same threads.

Both sides run float32 on the CPU, eagerly (transformers compiles a static-cache forward only on
accelerators; `disable_compile=True` makes that explicit), greedy, with no end-of-sequence token, so
every run produces exactly `new_tokens` tokens.

What is timed differs in one way that cannot be avoided: the lab's loop is timed step by step after an
untimed prefill, while `generate` runs prefill and decode in one call. The library's time per decode
step is therefore (one call generating new_tokens - one call generating 1) / (new_tokens - 1): it
includes generate's own per-step work (logits processors, stopping criteria, appending to input_ids),
which is part of what a user of the library pays.
"""

import statistics
import time

import torch
from tqdm.auto import tqdm

from ..cache import make_cache
from ..models import forward_cached, load


def _model(model):
    return load(model) if isinstance(model, str) else model


def random_ids(model, context, seed=0) -> torch.Tensor:
    """Seeded random token ids `[1, context]` (timing does not depend on the text)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, context), generator=g)


def _summary(per_token: list, **extra) -> dict:
    return dict(median=statistics.median(per_token), min=min(per_token), max=max(per_token), reps=len(per_token),
                threads=torch.get_num_threads(), **extra)


# ---- the lab --------------------------------------------------------------------------------------------

@torch.inference_mode()
def lab_greedy(model, ids, new_tokens, design="concat") -> list:
    """The lab's greedy continuation of ids `[1, T]`: `new_tokens` token ids (prefill, then new_tokens - 1 steps)."""
    cache = make_cache(design, model.config, ids.shape[1] + new_tokens)
    logits = forward_cached(ids, model.weights, model.config, cache, last_only=True)  # [1, 1, V]
    out = []
    while True:
        next_id = logits[:, -1].argmax(-1, keepdim=True)                                 # [1, 1]
        out.append(next_id.item())
        if len(out) == new_tokens:
            return out
        logits = forward_cached(next_id, model.weights, model.config, cache, last_only=True)


@torch.inference_mode()
def lab_decode_time(model, design, context=512, new_tokens=32, reps=3, seed=0, warmup=True) -> dict:
    """Seconds per decode step of the lab's `forward_cached` with a ConcatCache or a StaticCache.

    Per rep: a fresh cache, an untimed prefill of `context` random ids, then `new_tokens` timed greedy
    steps (each feeds the argmax). One warm-up rep is excluded. Returns median/min/max over reps.
    """
    model = _model(model)
    ids, w, cfg = random_ids(model, context, seed), model.weights, model.config
    per_token = []
    for rep in range(reps + 1) if warmup else range(1, reps + 1):
        cache = make_cache(design, model.config, context + new_tokens)
        logits = forward_cached(ids, w, cfg, cache, last_only=True)        # prefill, untimed
        t0 = time.perf_counter()
        for _ in range(new_tokens):                                         # decode_one_token, new_tokens times
            next_id = logits[:, -1].argmax(-1, keepdim=True)                # [1, 1]
            logits = forward_cached(next_id, w, cfg, cache, last_only=True)
        if rep:                                                             # rep 0 is the warm-up
            per_token.append((time.perf_counter() - t0) / new_tokens)
    return _summary(per_token, design=design, context=context, new_tokens=new_tokens)


# ---- the library ----------------------------------------------------------------------------------------

def _generate(hf, ids, new_tokens, cache_implementation):
    """transformers' greedy generate: exactly new_tokens tokens (no eos), eager, with the given cache."""
    with torch.inference_mode():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, cache_implementation=cache_implementation,
                           pad_token_id=0, eos_token_id=None, disable_compile=True)


def library_decode_time(model, cache_implementation, context=512, new_tokens=32, reps=3, seed=0, hf=None,
                        warmup=True) -> dict:
    """Seconds per decode step of transformers' `generate` with cache_implementation "dynamic" or "static".

    Per rep: one call generating 1 token (prefill only) and one generating new_tokens; the decode time per
    token is their difference / (new_tokens - 1). One warm-up of each is excluded. `hf`: an already built
    `to_transformers(model)`, to save building it again.
    """
    from ..models.hf import to_transformers

    if cache_implementation not in ("dynamic", "static"):
        raise ValueError(f"cache_implementation must be 'dynamic' or 'static', got {cache_implementation!r}")
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2: the decode time is (full - prefill) / (new_tokens - 1)")
    model = _model(model)
    hf = hf if hf is not None else to_transformers(model)
    ids = random_ids(model, context, seed)

    def timed(n):
        t0 = time.perf_counter()
        _generate(hf, ids, n, cache_implementation)
        return time.perf_counter() - t0

    per_token, full, prefill = [], [], []
    for rep in range(reps + 1) if warmup else range(1, reps + 1):
        p, f = timed(1), timed(new_tokens)
        if rep:                                                             # rep 0 is the warm-up
            prefill.append(p)
            full.append(f)
            per_token.append((f - p) / (new_tokens - 1))
    return _summary(per_token, cache_implementation=cache_implementation, context=context, new_tokens=new_tokens,
                    full_median=statistics.median(full), prefill_median=statistics.median(prefill))


# ---- the comparison -------------------------------------------------------------------------------------

def tokens_match(model, hf, context=512, new_tokens=32, seed=0) -> dict:
    """Do the lab's greedy tokens equal transformers' for the same ids? Returns both and the first mismatch."""
    ids = random_ids(model, context, seed)
    ours = lab_greedy(model, ids, new_tokens)
    theirs = _generate(hf, ids, new_tokens, "dynamic")[0, context:].tolist()
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    return dict(match=ours == theirs, lab=ours, library=theirs, first_mismatch=first)


def interleaved(model, hf, context, new_tokens, reps, bar=None) -> dict:
    """Time the four configurations in rounds (one warm-up of each, then `reps` rounds of all four), so that
    a slow spell of this shared machine hits every configuration alike instead of one block of reps."""
    runs = {f"lab_{d}": lambda d=d, **kw: lab_decode_time(model, d, context, new_tokens, **kw)
            for d in ("concat", "static")}
    runs |= {f"library_{i}": lambda i=i, **kw: library_decode_time(model, i, context, new_tokens, hf=hf, **kw)
             for i in ("dynamic", "static")}
    for run in runs.values():
        run(reps=1, warmup=False)                                           # warm-up, discarded
    per = {k: [] for k in runs}
    for _ in range(reps):
        for k, run in runs.items():
            per[k].append(run(reps=1, warmup=False)["median"])
            if bar is not None:
                bar.update(1 / reps)
    return {k: _summary(v) for k, v in per.items()}


def compare(model_names=("gpt2-random", "smollm2"), context=512, new_tokens=32, reps=3, progress=True) -> dict:
    """Seconds per decode token, lab vs library, per model, with lab/library ratios (> 1: the lab is slower)."""
    from ..models.hf import to_transformers

    out = {}
    bar = tqdm(total=5 * len(model_names), desc="lab vs transformers", disable=not progress)
    for name in model_names:
        model = load(name)
        hf = to_transformers(model)
        match = tokens_match(model, hf, context, new_tokens)
        bar.update()
        r = interleaved(model, hf, context, new_tokens, reps, bar)
        out[name] = dict(
            **{k: v["median"] for k, v in r.items()},
            ratio_static=r["lab_static"]["median"] / r["library_static"]["median"],
            ratio_concat=r["lab_concat"]["median"] / r["library_dynamic"]["median"],
            tokens_match=match["match"], first_mismatch=match["first_mismatch"],
            threads=torch.get_num_threads(), context=context, new_tokens=new_tokens, reps=reps,
            details=r)
    bar.close()
    return out
