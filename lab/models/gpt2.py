"""GPT-2 as a function of (ids, weights, config): the architecture of the seed chapter.

Weights keep their Hugging Face names, so a reader can hold this file beside `modeling_gpt2.py`.
GPT-2 stores its linear layers as Conv1D, `[in, out]`, so every projection is `x @ W + b`.
"""

import math

import torch
import torch.nn.functional as F

from .checks import check_ids


def split_heads(x, n_heads):  # [B, T, H*D] -> [B, H, T, D]
    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)


def merge_heads(x):  # [B, H, T, D] -> [B, T, H*D]
    return x.transpose(1, 2).flatten(2)


def gelu_new(x):  # the tanh approximation GPT-2 was trained with
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def block(x, w, i, config, attend):
    """One transformer block. `attend(i, q, k, v)` is the attention of layer i on `[B, H, T, D]`."""
    p, D, eps = f"transformer.h.{i}.", config.d_model, config.norm_eps
    h = F.layer_norm(x, (D,), w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
    q, k, v = (h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]).split(D, dim=-1)
    q, k, v = (split_heads(t, config.n_heads) for t in (q, k, v))  # [B, H, T, Dh]
    a = merge_heads(attend(i, q, k, v))                              # [B, T, D]
    x = x + a @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
    h = F.layer_norm(x, (D,), w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
    h = gelu_new(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
    return x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]


def embed(ids, w, positions):  # [B, T] -> [B, T, D]
    return w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][positions]


def embed_at(ids, w, config, positions):
    """The inputs of the first block for ids `[B, T]` at `positions` (`[T]` or `[B, T]`): `[B, T, D]`, and
    what every block needs of the positions: nothing more, the learned position rows are added here."""
    return embed(ids, w, positions), ()


def head(x, w, config):  # [B, T, D] -> [B, T, V]; the output head is the token embedding (tied)
    x = F.layer_norm(x, (config.d_model,), w["transformer.ln_f.weight"], w["transformer.ln_f.bias"],
                     config.norm_eps)
    return x @ w["transformer.wte.weight"].T


def causal_attention(i, q, k, v):  # every position sees itself and the positions before it
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def forward(ids, w, config, last_only=False):
    """Uncached forward: logits `[B, T, V]` for ids `[B, T]` (`[B, 1, V]` with last_only)."""
    ids = check_ids(ids, config)
    x = embed(ids, w, torch.arange(ids.shape[1], device=ids.device))
    for i in range(config.n_layers):
        x = block(x, w, i, config, causal_attention)
    return head(x[:, -1:] if last_only else x, w, config)
