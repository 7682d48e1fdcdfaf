"""Comparisons of score vectors and text likelihood, and the teacher-forced quality of a cache (`quality`)."""

import math

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .cache import ConcatCache
from .models import forward, forward_cached


def logit_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Largest and median |a - b| over every element (logits of the same positions)."""
    d = (a.float() - b.float()).abs().flatten()
    return dict(max=d.max().item(), median=d.median().item())


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats over the last dimension, from logits; p is the reference."""
    p_log, q_log = F.log_softmax(p_logits.double(), -1), F.log_softmax(q_logits.double(), -1)
    return (p_log.exp() * (p_log - q_log)).sum(-1)


@torch.inference_mode()
def perplexity(model, sequences) -> float:
    """exp(mean negative log-likelihood of each next token), over every predicted position of every sequence."""
    nll, count = 0.0, 0
    for ids in sequences:
        ids = torch.as_tensor(ids, dtype=torch.long)[None]                # [1, T]
        logits = forward(ids, model.weights, model.config)[0, :-1]         # [T-1, V]
        nll += F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return math.exp(nll / count)


def roc(labels, scores) -> dict:
    """ROC curve and its area for `scores` (higher: more likely label 1). AUC = P(score of a 1 > score of
    a 0), ties counting a half (the Mann-Whitney statistic)."""
    labels, scores = np.asarray(labels, bool), np.asarray(scores, float)
    pos, neg = scores[labels], scores[~labels]
    auc = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))
    thresholds = np.r_[np.inf, np.sort(np.unique(scores))[::-1]]
    tpr = [(pos >= t).mean() for t in thresholds]
    fpr = [(neg >= t).mean() for t in thresholds]
    return dict(auc=float(auc), fpr=[float(x) for x in fpr], tpr=[float(x) for x in tpr])


# ---- teacher-forced quality through a cache: a prefill, then one token per step, against the plain forward ----
#
# Held-out passages go through a cache the way serving feeds them: a prompt in one prefill step, then one
# token per step, each step's own key and value joining the cache at `advance` (where a QuantizedCache
# quantizes and an EvictingCache evicts). Every next-token distribution from the prefill's last position on
# is compared with the one the uncompressed model gives at the same position; the oracle is the plain
# forward over the whole passage, no cache at all.

def as_batch(ids) -> torch.Tensor:
    """ids: one passage (a list of ids), several of equal length, or a LongTensor -> `[B, T]`."""
    x = torch.as_tensor(ids)
    return x[None] if x.dim() == 1 else x


@torch.inference_mode()
def teacher_forced(model, ids, cache, prefill: int) -> torch.Tensor:
    """Next-token logits at every position from `prefill - 1` on, `[B, T - prefill + 1, V]`: the passages'
    first `prefill` tokens in one step, then one token per step through `cache` (batch size B)."""
    w, cfg, x = model.weights, model.config, as_batch(ids)
    rows = [forward_cached(x[:, :prefill], w, cfg, cache, last_only=True)[:, -1]]    # [B, V]
    for t in range(prefill, x.shape[1]):
        rows.append(forward_cached(x[:, t:t + 1], w, cfg, cache)[:, -1])
    return torch.stack(rows, dim=1)


@torch.inference_mode()
def reference(model, ids, prefill: int) -> torch.Tensor:
    """The oracle: the plain forward's logits at the same positions, `[B, T - prefill + 1, V]`, a passage
    at a time (a [B, T, V] tensor of logits would be gigabytes at T = 2,048)."""
    return torch.stack([forward(row[None], model.weights, model.config)[0, prefill - 1:] for row in as_batch(ids)])


def compare(logits, reference, targets) -> dict:
    """logits, reference `[..., N + 1, V]` at the same positions, targets `[..., N]` the tokens that follow
    (the last position has none: it is left out). Mean KL(reference || logits) in nats, the change in mean
    next-token loss and perplexity, top-1 agreement, and each passage's loss (the spread gives the noise)."""
    n, V = targets.shape[-1], logits.shape[-1]
    logits, reference = logits[..., :n, :].double(), reference[..., :n, :].double()
    kl = kl_divergence(reference, logits)                                           # [..., N]
    nll = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="none").view(targets.shape)
    ref_nll = F.cross_entropy(reference.reshape(-1, V), targets.reshape(-1), reduction="none")
    loss, ref_loss = float(nll.mean()), float(ref_nll.mean())
    return dict(kl=float(kl.mean()), kl_max=float(kl.max()), loss=loss, ref_loss=ref_loss,
                delta_ppl=math.exp(loss) - math.exp(ref_loss),
                top1=float((logits.argmax(-1) == reference.argmax(-1)).double().mean()),
                passage_loss=nll.reshape(-1, n).mean(-1).tolist(), positions=targets.numel())


@torch.inference_mode()
def quality(model, ids, make_cache, prefill: int = 64, ref=None) -> dict:
    """`compare` for the cache `make_cache(config, batch_size)` fed passages ids `[B, T]` teacher-forced,
    against the plain forward (`ref`, if already computed by `reference`), with the bytes the cache held at
    the end (`nbytes`), the passages' `length` T and `batch` B."""
    x = as_batch(ids)
    ref = reference(model, x, prefill) if ref is None else ref
    cache = make_cache(model.config, x.shape[0])
    got = teacher_forced(model, x, cache, prefill)
    return compare(got, ref, x[:, prefill:]) | dict(nbytes=cache.nbytes(), length=x.shape[1], batch=x.shape[0])


def sweep(model, ids, prefill, cases: dict, ref=None, desc="caches") -> dict:
    """{name: `quality`} for caches {name: make_cache} on the same passages, the oracle computed once."""
    ref = reference(model, ids, prefill) if ref is None else ref
    return {name: quality(model, ids, make, prefill, ref) for name, make in tqdm(cases.items(), desc=desc)}


# ---- which positions the eviction policies keep -------------------------------------------------------------

@torch.inference_mode()
def key_spread(model, ids) -> dict:
    """How unevenly the keys fill their range, over every layer and KV head of one prefill of `ids` (a
    passage, or `[B, T]` of which the first row is used): the largest channel's absmax over the median
    channel's (outlier channels make it large), and how much larger one scale for the whole tensor is than
    a token's own (the resolution a per-tensor scale gives up)."""
    cache = ConcatCache(model.config)
    forward_cached(as_batch(ids)[:1], model.weights, model.config, cache, last_only=True)
    channel, token = [], []
    for k in cache.keys:                                                            # [1, H_kv, T, D]
        per_channel = k[0].abs().amax(dim=1)                                        # [H_kv, D]
        channel.append(per_channel.amax(-1) / per_channel.median(-1).values)
        per_token = k[0].abs().amax(dim=-1)                                         # [H_kv, T]
        token.append(k.abs().amax() / per_token.median())
    channel = torch.cat(channel)
    return dict(channel_max=float(channel.max()), channel_median=float(channel.median()),
                tensor_over_token=float(torch.stack(token).median()))


def ratio_interval(nums, dens, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> tuple:
    """A percentile bootstrap interval of sum(nums) / sum(dens), resampling the units (passages, prompts) the
    pairs belong to: how far the pooled ratio (guesses accepted over proposed, say) could move with other units
    drawn from the same source. A unit with nothing in its denominator still counts as drawn. (lo, hi)."""
    nums, dens = np.asarray(nums, dtype=float), np.asarray(dens, dtype=float)            # [units]
    picks = np.random.default_rng(seed).integers(0, len(nums), (resamples, len(nums)))   # [resamples, units]
    num, den = nums[picks].sum(1), dens[picks].sum(1)
    ratios = num[den > 0] / den[den > 0]
    tail = (1 - level) / 2
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1 - tail))
