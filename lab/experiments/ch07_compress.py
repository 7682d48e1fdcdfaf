"""Chapter 7, "A smaller cache": what fewer bits per value, or fewer positions kept, cost in model quality.

The measurement every comparison of the chapter shares: feed held-out text through a cache the way decoding
does (a prefill, then one token per step, each step's own key and value joining the cache at `advance`,
where a QuantizedCache quantizes and an EvictingCache evicts), and compare each next-token distribution
with the one the uncompressed model gives at the same position: KL divergence, change in loss, top-1
agreement. The oracle is the plain forward over the whole text, no cache at all.
"""

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..cache import ConcatCache, EvictingCache, QuantizedCache
from ..models import forward, forward_cached

SECTION = "ch07"

# name -> QuantizedCache settings: the schemes and bit widths the chapter compares
QUANTIZED = {
    "per_token_8": dict(bits=8, scheme="per_token"),
    "per_token_8_smooth": dict(bits=8, scheme="per_token", smooth=True),
    "per_token_4": dict(bits=4, scheme="per_token"),
    "per_token_4_smooth": dict(bits=4, scheme="per_token", smooth=True),
    "kivi_4": dict(bits=4, scheme="kivi", group_size=32, residual=128),
    "kivi_2": dict(bits=2, scheme="kivi", group_size=32, residual=128),
}
POLICIES = ("window", "sinks", "h2o", "snapkv")


@torch.inference_mode()
def teacher_forced(model, ids: list, cache, prefill: int) -> torch.Tensor:
    """Next-token logits at every position from `prefill - 1` on, `[len(ids) - prefill + 1, V]`: the prompt's
    first `prefill` tokens in one step, then one token per step through `cache`."""
    w, cfg, x = model.weights, model.config, torch.tensor([ids])
    rows = [forward_cached(x[:, :prefill], w, cfg, cache, last_only=True)[0, -1]]
    for t in range(prefill, len(ids)):
        rows.append(forward_cached(x[:, t:t + 1], w, cfg, cache)[0, -1])
    return torch.stack(rows)


def compare(logits, reference, targets) -> dict:
    """logits, reference `[N, V]` at the same positions, targets `[N]` the tokens that follow (the last row
    has none: it is left out). Mean KL(reference || logits) in nats, the change in mean next-token loss,
    top-1 agreement."""
    logits, reference = logits[:len(targets)].double(), reference[:len(targets)].double()
    logp, logq = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)                               # [N]
    loss = F.cross_entropy(logits, targets)
    ref_loss = F.cross_entropy(reference, targets)
    return dict(kl=float(kl.mean()), kl_max=float(kl.max()), loss=float(loss), ref_loss=float(ref_loss),
                delta_ppl=math.exp(loss) - math.exp(ref_loss),
                top1=float((logits.argmax(-1) == reference.argmax(-1)).double().mean()), positions=len(targets))


@torch.inference_mode()
def quality(model, ids: list, make_cache, prefill: int = 64) -> dict:
    """`compare` for the cache `make_cache(config)` against the plain forward over the whole text."""
    reference = forward(torch.tensor([ids]), model.weights, model.config)[0, prefill - 1:]   # [N + 1, V]
    cache = make_cache(model.config)
    got = teacher_forced(model, ids, cache, prefill)
    return compare(got, reference, torch.tensor(ids[prefill:])) | dict(nbytes=cache.nbytes(), length=len(ids))


def quantized(**settings):
    return lambda config: QuantizedCache(config, **settings)


def evicting(budget, policy, **settings):
    return lambda config: EvictingCache(config, budget, policy, **settings)


def sweep(model, ids, prefill=64, budgets=(64, 128, 256), schemes=QUANTIZED, policies=POLICIES) -> dict:
    """Every quantized scheme and every eviction policy at every budget, and the float cache itself (whose
    KL must be rounding only): {name: quality}."""
    cases = {"float": lambda config: ConcatCache(config)}
    cases |= {name: quantized(**s) for name, s in schemes.items()}
    cases |= {f"{p}_{b}": evicting(b, p) for p in policies for b in budgets}
    return {name: quality(model, ids, make, prefill) for name, make in tqdm(cases.items(), desc="caches")}
