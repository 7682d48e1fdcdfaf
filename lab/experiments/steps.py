"""`LAB_FULL=1 python -m lab.experiments.steps`: one decode step of every engine shape beside the plain one,
at the same batch and positions (section `steps`, cited by chapters 10 and 11). Quick mode by default.

Every shape should cost what it reads, no more:
- the hybrid engine (chapter 10: one global layer in six, window 1,024, pages of 16) at 4,096 positions and
  at 8,000 (near SmolLM2's 8,192), keys `hybrid_short` and `hybrid_long`: its local layers read their
  window and sinks only, in place;
- the radix engine (chapter 11) at 1,000 positions, pages of 16 (the tree's tokens whole pages) and of one
  position (a prefix to the token: block tables 16 times as wide).

The model: SmolLM2's heads and widths with 6 of its 30 layers, random token ids (a step's time does not
depend on the text). Fewer layers leave the per-layer ratio of attention to weights as it is, and make the
per-step work outside the layers (planning, sampling) a larger share: a harsher test of the engines' own
bookkeeping, in a fifth of the time. 16 sequences, each engine's steps interleaved round by round
(`lab.step_cost.engine_steps`); ratios are per round, medians with their quartiles. Quick mode: 4
sequences at 1,024 and 2,048 positions, window 128; notebooks 10 and 11 each run their part (`hybrid`, `radix`).
"""

import dataclasses
import random
import time

import torch
from tqdm.auto import tqdm

from ..engine import ServingEngine
from ..models import load
from ..models.retrofit import local_layers
from ..results import provenance, quick, require_clean, value, write_section
from ..step_cost import engine_steps

FULL = dict(batch=16, layers=6, window=1024, short=4096, long=8000, radix=1000, rounds=9)
QUICK = dict(batch=4, layers=6, window=128, short=1024, long=2048, radix=128, rounds=3)


def settings(quick_mode=None) -> dict:
    return QUICK if (quick() if quick_mode is None else quick_mode) else FULL


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def new(batch: int, length: int) -> int:
    """Tokens each request may generate: enough to outlast the prefill (the first requests decode while the
    last prefill, 2,048 tokens a step) and the timed rounds."""
    return batch * length // 2048 + 32


def smollm2_shaped(s: dict):
    base = load("smollm2")
    return base, dataclasses.replace(base, config=dataclasses.replace(base.config, n_layers=s["layers"]))


def hybrid(quick_mode=None) -> dict:
    """The plain and the hybrid engine at the shorter and the longer context."""
    s = settings(quick_mode)
    base, model = smollm2_shaped(s)
    local, B, out = local_layers(model, window=s["window"], global_every=6), s["batch"], {}
    for part in tqdm(("short", "long"), desc="plain and hybrid engine: contexts"):
        T, pages = s[part], B * (s[part] // 16 + 8)
        engines = dict(plain=ServingEngine(model, pages, 16, 2048, prefix_caching=False),
                       hybrid=ServingEngine(local, pages, 16, 2048, prefix_caching=False))
        out[f"hybrid_{part}"] = engine_steps(engines, prompts(B, T, model.config.vocab_size, T),
                                             rounds=s["rounds"], new_tokens=new(B, T))
    return out | dict(settings=s, manifest=base.manifest, threads=torch.get_num_threads())


def radix(quick_mode=None) -> dict:
    """The plain engine and the radix engine on pages of 16 and of one position."""
    s = settings(quick_mode)
    base, model = smollm2_shaped(s)
    B, T = s["batch"], s["radix"]
    pages = B * (T // 16 + 8)
    engines = dict(plain=ServingEngine(model, pages, 16, 2048), radix=ServingEngine(model, pages, 16, 2048,
                   prefix_caching="radix"), radix_1=ServingEngine(model, pages * 16, 1, 2048, prefix_caching="radix"))
    out = engine_steps(engines, prompts(B, T, model.config.vocab_size, T), rounds=s["rounds"], new_tokens=new(B, T))
    return dict(radix=out, settings=s, manifest=base.manifest, threads=torch.get_num_threads())


def measure(quick_mode=None) -> dict:
    return hybrid(quick_mode) | radix(quick_mode)


def values(m: dict) -> dict:
    """The section's values, from the parts m holds (a notebook measures one part)."""
    def side(r, name):
        ratio = r[name]["over_base"]
        return dict(ms=value(r[name]["step_s"] * 1e3, "ms"), read_mib=value(r[name]["kv_read_bytes"] / 2**20, "MiB"),
                    over_plain=value(ratio["median"], "x", q1=ratio["q1"], q3=ratio["q3"], n=ratio["n"]))

    s = m["settings"]
    v = dict(settings=dict(sequences=value(s["batch"], "sequences"), layers=value(s["layers"], "layers"),
                           window=value(s["window"], "positions")))
    for part in ("short", "long"):
        if f"hybrid_{part}" in m:
            r = m[f"hybrid_{part}"]
            v[f"hybrid_{part}"] = dict(plain=side(r, "plain"), hybrid=side(r, "hybrid"),
                                       positions=value(s[part], "positions"))
    if "radix" in m:
        r = m["radix"]
        v["radix"] = dict(plain=side(r, "plain"), pages_16=side(r, "radix"), pages_1=side(r, "radix_1"),
                          positions=value(s["radix"], "positions"))
    return v


def record(m: dict):
    write_section("steps", values(m), provenance(manifest=m["manifest"], threads=m["threads"]))


if __name__ == "__main__":
    require_clean()
    t0 = time.perf_counter()
    record(measure())
    print(f"steps: done in {time.perf_counter() - t0:.0f} s")
