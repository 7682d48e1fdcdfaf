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

from functools import partial

import torch
from tqdm.auto import tqdm

from ..bench import summarize, time_rounds
from ..cache import make_cache
from ..models import forward_cached, load


def _model(model):
    return load(model) if isinstance(model, str) else model


def random_ids(model, context, seed=0) -> torch.Tensor:
    """Seeded random token ids `[1, context]` (timing does not depend on the text)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, context), generator=g)


def _summary(per_token: list, **extra) -> dict:
    """lab.bench.summarize of seconds per decode token (median, min, max, iqr, n, threads); n again as reps."""
    return summarize(per_token) | dict(reps=len(per_token), **extra)


# ---- the lab --------------------------------------------------------------------------------------------

@torch.inference_mode()
def _prefill(model, design, ids, new_tokens):
    """A new cache of `design` holding ids `[1, T]` with room for new_tokens more, and the greedy next
    id `[1, 1]`."""
    cache = make_cache(design, model.config, ids.shape[1] + new_tokens)
    logits = forward_cached(ids, model.weights, model.config, cache, last_only=True)  # [1, 1, V]
    return cache, logits[:, -1].argmax(-1, keepdim=True)


def _decode(model, cache, next_id, steps) -> list:
    """`steps` greedy decode steps through cache: feed next_id `[1, 1]`, then each step's argmax. Returns
    the ids chosen, `[1, 1]` each (tensors: reading them would wait on the device inside a timing)."""
    chosen = []
    for _ in range(steps):
        logits = forward_cached(next_id, model.weights, model.config, cache, last_only=True)  # [1, 1, V]
        next_id = logits[:, -1].argmax(-1, keepdim=True)                                       # [1, 1]
        chosen.append(next_id)
    return chosen


@torch.inference_mode()
def lab_greedy(model, ids, new_tokens, design="concat") -> list:
    """The lab's greedy continuation of ids `[1, T]`: `new_tokens` token ids (prefill, then new_tokens - 1 steps)."""
    cache, first = _prefill(model, design, ids, new_tokens)
    return [int(t) for t in [first] + _decode(model, cache, first, new_tokens - 1)]


def lab_decode_time(model, design, context=512, new_tokens=32, reps=3, seed=0, warmup=True) -> dict:
    """Seconds per decode step of the lab's `forward_cached` with a ConcatCache or a StaticCache.

    Per rep: a fresh cache and a prefill of `context` random ids, untimed (lab.bench's setup), then
    `new_tokens` timed greedy steps (each feeds the argmax). One warm-up rep is excluded. Returns
    median/min/max over reps.
    """
    model = _model(model)
    ids, cache, first = random_ids(model, context, seed), None, None

    def fresh():
        nonlocal cache, first
        cache, first = _prefill(model, design, ids, new_tokens)

    decode = {design: lambda: _decode(model, cache, first, new_tokens)}
    r = time_rounds(decode, warmup=int(warmup), rounds=reps, setup=fresh, samples=True)[design]
    return _summary([t / new_tokens for t in r["samples"]], design=design, context=context, new_tokens=new_tokens)


# ---- the library ----------------------------------------------------------------------------------------

def _generate(hf, ids, new_tokens, cache_implementation):
    """transformers' greedy generate: exactly new_tokens tokens (no eos), eager, with the given cache."""
    with torch.inference_mode():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, cache_implementation=cache_implementation,
                           pad_token_id=0, eos_token_id=None, disable_compile=True)


def _library_calls(hf, ids, new_tokens, cache_implementation) -> dict:
    """The two timed calls behind the library's decode time: generate 1 token (the prefill), then new_tokens."""
    name = f"library_{cache_implementation}"
    return {f"{name}_prefill": partial(_generate, hf, ids, 1, cache_implementation),
            name: partial(_generate, hf, ids, new_tokens, cache_implementation)}


def _library_per_token(rounds: dict, cache_implementation, new_tokens) -> list:
    """(full - prefill) / (new_tokens - 1) of each round of `_library_calls`' timings."""
    name = f"library_{cache_implementation}"
    full, prefill = rounds[name]["samples"], rounds[f"{name}_prefill"]["samples"]
    return [(f - p) / (new_tokens - 1) for f, p in zip(full, prefill, strict=True)]


def library_decode_time(model, cache_implementation, context=512, new_tokens=32, reps=3, seed=0, hf=None,
                        warmup=True) -> dict:
    """Seconds per decode step of transformers' `generate` with cache_implementation "dynamic" or "static".

    Per rep: one call generating 1 token (prefill only) and one generating new_tokens, in turn
    (lab.bench.time_rounds); the decode time per token is their difference / (new_tokens - 1). One
    warm-up of each is excluded. `hf`: an already built `to_transformers(model)`, to save building it again.
    """
    from ..models.hf import to_transformers

    if cache_implementation not in ("dynamic", "static"):
        raise ValueError(f"cache_implementation must be 'dynamic' or 'static', got {cache_implementation!r}")
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2: the decode time is (full - prefill) / (new_tokens - 1)")
    model = _model(model)
    hf = hf if hf is not None else to_transformers(model)
    calls = _library_calls(hf, random_ids(model, context, seed), new_tokens, cache_implementation)
    r = time_rounds(calls, warmup=int(warmup), rounds=reps, samples=True)
    prefill, full = (r[name]["median"] for name in calls)
    return _summary(_library_per_token(r, cache_implementation, new_tokens), cache_implementation=cache_implementation,
                    context=context, new_tokens=new_tokens, full_median=full, prefill_median=prefill)


# ---- the comparison -------------------------------------------------------------------------------------

def tokens_match(model, hf, context=512, new_tokens=32, seed=0) -> dict:
    """Do the lab's greedy tokens equal transformers' for the same ids? Returns both and the first mismatch."""
    ids = random_ids(model, context, seed)
    ours = lab_greedy(model, ids, new_tokens)
    theirs = _generate(hf, ids, new_tokens, "dynamic")[0, context:].tolist()
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    return dict(match=ours == theirs, lab=ours, library=theirs, first_mismatch=first)


def interleaved(model, hf, context, new_tokens, reps, seed=0) -> dict:
    """Seconds per decode token of the four configurations, timed in rounds (lab.bench.time_rounds: one
    warm-up of each, then `reps` rounds of all of them in turn), so that a slow spell of this shared machine
    hits every configuration alike instead of one block of reps.

    The lab's two caches are prefilled once, and cropped back to `context` before every call (untimed);
    each call then times `new_tokens` greedy steps. The library's time per token is, round by round,
    (generate new_tokens - generate 1) / (new_tokens - 1)."""
    ids = random_ids(model, context, seed)
    lab = {d: _prefill(model, d, ids, new_tokens) for d in ("concat", "static")}  # {design: (cache, next id)}
    calls = {f"lab_{d}": partial(_decode, model, cache, first, new_tokens) for d, (cache, first) in lab.items()}
    for impl in ("dynamic", "static"):
        calls |= _library_calls(hf, ids, new_tokens, impl)
    crop_all = lambda: [cache.crop(context) for cache, _ in lab.values()]
    r = time_rounds(calls, warmup=1, rounds=reps, setup=crop_all, samples=True)
    out = {f"lab_{d}": _summary([t / new_tokens for t in r[f"lab_{d}"]["samples"]]) for d in lab}
    return out | {f"library_{i}": _summary(_library_per_token(r, i, new_tokens)) for i in ("dynamic", "static")}


def compare(model_names=("gpt2-random", "smollm2"), context=512, new_tokens=32, reps=3, progress=True) -> dict:
    """Seconds per decode token, lab vs library, per model, with lab/library ratios (> 1: the lab is slower)."""
    from ..models.hf import to_transformers

    out = {}
    for name in tqdm(model_names, desc="lab vs transformers", disable=not progress):
        model = load(name)
        hf = to_transformers(model)
        match = tokens_match(model, hf, context, new_tokens)
        r = interleaved(model, hf, context, new_tokens, reps)
        out[name] = dict(
            **{k: v["median"] for k, v in r.items()},
            ratio_static=r["lab_static"]["median"] / r["library_static"]["median"],
            ratio_concat=r["lab_concat"]["median"] / r["library_dynamic"]["median"],
            tokens_match=match["match"], first_mismatch=match["first_mismatch"],
            threads=torch.get_num_threads(), context=context, new_tokens=new_tokens, reps=reps,
            details=r)
    return out
