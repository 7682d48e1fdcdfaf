"""Models: `load(name)`, and functional forwards for the GPT-2 and Llama families."""

from . import gpt2, llama, retrofit
from .checks import InputError, PositionLimitError, check_ids, check_positions, owner
from .config import ModelConfig
from .load import KNOWN, DtypeError, Model, load, random_model


def forward(ids, weights, config, last_only=False):
    """Uncached forward, the oracle every cache is checked against: ids `[B, T]` -> logits `[B, T, V]`."""
    family = gpt2 if config.arch == "gpt2" else llama if config.as_trained else retrofit   # retrofit: ch. 10
    return family.forward(ids, weights, config, last_only=last_only)


def forward_cached(ids, weights, config, cache, last_only=False, positions=None, logits_at=None,
                   state=None):
    """Forward through `cache`: ids `[B, T]` (after the cache's length) -> logits `[B, T, V]`.

    Prefill, chunked prefill and decode are one call, for both families: only `embed_at`, `block`
    and `head` belong to the architecture. The cache refuses another model's state
    (CacheMismatchError). `positions` `[T]` overrides where the model is told the tokens sit
    (chapter 4's stale offset; a serving step's plan passes its own); `logits_at` `[K]` keeps those
    tokens' logits only, `[B, K, V]`; `state` is `owner(weights, config)` when the caller has just
    computed it (the serving engine, once a step). The differences from `forward` are marked NEW.
    """
    family = gpt2 if config.arch == "gpt2" else llama
    cache.check_model(config, state or owner(weights, config))  # NEW: the cache holds its state
    if positions is None:                                # NEW: continue after the cache
        ids = check_ids(ids, config, offset=cache.max_length)
        positions = cache.next_positions(ids.shape[1], ids.device)
    else:
        ids = check_ids(ids, config)
        check_positions(positions, config)
    x, at = family.embed_at(ids, weights, config, positions)  # NEW: tokens at their positions
    block = getattr(weights, "block", family.block)  # the engine's Prepacked brings its own (ch. 8)
    block = block if config.as_trained else retrofit.block  # a retrofit reshapes the layer (ch. 10)
    for i in range(config.n_layers):
        x = block(x, weights, i, config, cache.attend, *at)  # NEW: k, v via the cache
    cache.advance(ids.shape[1])                          # NEW: commit the T positions
    if logits_at is not None:                            # a serving step's sampled tokens (ch. 8)
        x = x[:, logits_at]
    return family.head(x[:, -1:] if last_only else x, weights, config)


__all__ = ["load", "forward", "forward_cached", "Model", "ModelConfig", "InputError", "PositionLimitError",
           "DtypeError", "check_ids", "owner", "random_model", "KNOWN"]
