"""Models: `load(name)`, and functional forwards for the GPT-2 and Llama families."""

from . import gpt2, llama
from .checks import InputError, PositionLimitError, check_ids, owner
from .config import ModelConfig
from .load import KNOWN, Model, load, random_model


def forward(ids, weights, config, last_only=False):
    """Uncached forward, the oracle every cache is checked against: ids `[B, T]` -> logits `[B, T, V]`."""
    family = gpt2 if config.arch == "gpt2" else llama
    return family.forward(ids, weights, config, last_only=last_only)


def forward_cached(ids, weights, config, cache, last_only=False, positions=None, logits_at=None):
    """Forward through `cache`: ids `[B, T]` are the T tokens after the cache's length; logits `[B, T, V]`.

    Prefill (empty cache), chunked prefill (several calls) and decode (T = 1) are the same call. The cache
    records which model filled it and refuses another (CacheMismatchError). `positions` (`[T]`) overrides
    the positions the model is told the new tokens sit at (default: the cache's next ones); the keys are
    stored after the cache's positions whatever they are, so another value mis-positions the tokens on
    purpose (chapter 4's stale offset). `logits_at` (`[K]` token indices) keeps only those tokens' logits,
    `[B, K, V]`: a serving step (chapter 8) samples from one token per sequence, so the head skips the rest.
    """
    family = gpt2 if config.arch == "gpt2" else llama
    return family.forward_cached(ids, weights, config, cache, last_only=last_only, positions=positions,
                                 logits_at=logits_at)


__all__ = ["load", "forward", "forward_cached", "Model", "ModelConfig", "InputError", "PositionLimitError",
           "check_ids", "owner", "random_model", "KNOWN"]
