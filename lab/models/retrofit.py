"""Retrofits: a new Model from an old one, which every cache, backend and the engine accept.

`with_outlier_channels` computes the same function with keys whose range is uneven (chapter 7's
quantizers meet outlier channels this way).
"""

import torch

from .load import Model

OUTLIER_FACTOR, OUTLIER_PAIRS = 16.0, (3,)


def with_outlier_channels(model, factor=OUTLIER_FACTOR, pairs=OUTLIER_PAIRS):
    """The same function with keys that have outlier channels: in every layer and KV head, the key
    projection's rows for channels i and i + D/2 (a pair RoPE rotates together) times `factor`, the
    matching rows of every query head of the group divided by it. q . k is unchanged (exactly, for a power
    of two), the keys' range is not: what a model whose keys have outlier channels gives a quantizer."""
    cfg, weights = model.config, dict(model.weights)
    D = cfg.head_dim
    channels = torch.tensor([c for i in pairs for c in (i, i + D // 2)])
    for i in range(cfg.n_layers):
        k_name, q_name = (f"model.layers.{i}.self_attn.{x}_proj.weight" for x in "kq")
        k, q = weights[k_name].clone(), weights[q_name].clone()                 # [H_kv * D, d], [H_q * D, d]
        k.view(cfg.n_kv_heads, D, -1)[:, channels] *= factor
        q.view(cfg.n_heads, D, -1)[:, channels] /= factor
        weights[k_name], weights[q_name] = k, q
    return Model(f"{model.name}-outlier-keys", cfg, weights, model.tokenizer)
