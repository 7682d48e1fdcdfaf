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


@torch.inference_mode()
def kept_positions(model, ids: list, policy: str, budget: int, layer: int = 0, prefill: int = 64, **settings):
    """Which original positions each KV head of `layer` holds after `ids` went through an EvictingCache:
    a bool map `[H_kv, len(ids)]` (the heat map of what H2O and SnapKV keep)."""
    cache = EvictingCache(model.config, budget, policy, **settings)
    teacher_forced(model, ids, cache, prefill)
    kept = cache.kept_positions[layer][0]                                     # [H_kv, held]
    out = torch.zeros(kept.shape[0], len(ids), dtype=torch.bool)
    out.scatter_(1, kept, True)
    return out


def plot_kl_bytes(results: dict, float_bytes: float, path=None):
    """KL against bytes per position (as a share of the float cache's) for every quantized scheme."""
    from . import plots
    from .plots import finish

    fig, ax = plots.figure(height=3.6)
    for name, r in results.items():
        share = r["nbytes"] / float_bytes
        ax.plot(share, max(r["kl"], 1e-12), "o")
        ax.annotate(name.replace("_", " "), (share, max(r["kl"], 1e-12)), textcoords="offset points",
                    xytext=(4, 4))
    ax.margins(0.15)                                                     # room for the labels
    ax.set(yscale="log", xlabel="bytes held / the float cache's", ylabel="KL to the float cache (nats)",
           title="Fewer bits: quality against memory")
    return finish(fig, path)


def plot_loss_budget(results: dict, policies=POLICIES, ref_loss=None, path=None):
    """Held-out loss against the budget, a line per eviction policy; `results` keyed "{policy}_{budget}"."""
    from . import plots
    from .plots import finish

    fig, ax = plots.figure(height=3.6)
    for p in policies:
        budgets = sorted(int(k.rsplit("_", 1)[1]) for k in results if k.rsplit("_", 1)[0] == p)
        ax.plot(budgets, [results[f"{p}_{b}"]["loss"] for b in budgets], "o-", label=p)
    if ref_loss is not None:
        ax.axhline(ref_loss, ls=":", color="gray", label="every position kept")
    ax.set(xscale="log", xlabel="budget (positions kept per head)", ylabel="next-token loss (nats)",
           title="Fewer positions: loss against budget")
    ax.legend()
    return finish(fig, path)


def plot_kept(maps: dict, path=None):
    """maps {policy: [H_kv, T] bool}: which positions each head keeps, one panel per policy."""
    from . import plots
    from .plots import finish

    fig, axes = plots.figure(nrows=len(maps), height=1.4 * len(maps) + 0.8)
    for ax, (name, m) in zip([axes] if len(maps) == 1 else axes, maps.items(), strict=True):
        ax.imshow(m.float().numpy(), aspect="auto", interpolation="nearest", cmap="Greys")
        ax.set(ylabel="KV head", title=f"{name}: positions kept (black)")
        ax.set_yticks(range(m.shape[0]))
    (axes if len(maps) == 1 else axes[-1]).set_xlabel("position in the text")
    return finish(fig, path)
