"""The Llama family (SmolLM2, Llama, Qwen2/3) as a function of (ids, weights, config).

Differences from GPT-2: RMSNorm instead of LayerNorm, rotary position embeddings (RoPE) applied to
queries and keys instead of a learned position table, grouped-query attention (fewer key/value heads
than query heads), and a gated SiLU MLP. Weights keep their Hugging Face names; nn.Linear stores
`[out, in]`, so projections are `F.linear(x, W)`.
"""

import torch
import torch.nn.functional as F

from .checks import check_ids
from .gpt2 import merge_heads, split_heads


def rms_norm(x, weight, eps):  # normalise by the root mean square, in float32 as the reference does
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(positions, head_dim, theta, dtype):
    """cos and sin `[T, D]` of angle position * theta^(-2j/D) for pair j; computed once per forward."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)  # [D/2]
    angles = positions.float()[..., None] * inv_freq                                                   # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)                                                       # [T, D]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    if positions.dim() == 2:  # [B, T] positions (sequences of different lengths): broadcast over heads
        cos, sin = cos[:, None], sin[:, None]                                                           # [B, 1, T, D]
    return cos, sin


def rope(x, cos, sin):
    """Rotate the pairs (j, j + D/2) of every head of x `[B, H, T, D]` by the angles in cos, sin `[T, D]`."""
    D = x.shape[-1]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def project(h, w, name):  # a linear layer, with its bias when the checkpoint has one (Qwen2)
    packed = getattr(w, "packed", {}).get(name)                    # see Prepacked, for CPU serving
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(h, packed, w.get(name + ".bias"), "none", [], "")
    return F.linear(h, w[name + ".weight"], w.get(name + ".bias"))


class Prepacked(dict):
    """The same weights, each projection also held in oneDNN's blocked layout (`packed[name]`), as vLLM's
    CPU backend holds them. A product with few rows (a decode step's) is bound by reading the weights, and
    `F.linear` repacks each weight on every call; the packed copy is read as it lies: about twice as fast
    at 16 rows on SmolLM2 (lab/experiments/ch08_serving.py measures it). The dict's tensors are the
    model's own, so `owner` and the manifest see the same state; the copies cost the weights' memory again."""

    def __init__(self, weights: dict, rows: int = 16):
        super().__init__(weights)
        names = [n.removesuffix(".weight") for n in weights if n.endswith("_proj.weight")]
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self.packed = {n: torch.ops.mkldnn._reorder_linear_weight(weights[n + ".weight"], rows) for n in names}
        self.packed["lm_head"] = torch.ops.mkldnn._reorder_linear_weight(head, rows)

    @staticmethod
    def applies(weights: dict) -> bool:  # float32 on a CPU with oneDNN
        t = next(iter(weights.values()))
        return torch.backends.mkldnn.is_available() and t.device.type == "cpu" and t.dtype == torch.float32


def block(x, w, i, config, attend, rope_cs):
    """One decoder layer. `attend(i, q, k, v)` is layer i's attention on q `[B, Hq, T, D]` and
    k, v `[B, Hkv, T, D]`; rope_cs = (cos, sin), each `[T, D]`, from `rope_tables`."""
    p, eps = f"model.layers.{i}.", config.norm_eps
    h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
    q = split_heads(project(h, w, p + "self_attn.q_proj"), config.n_heads)     # [B, Hq, T, D]
    k = split_heads(project(h, w, p + "self_attn.k_proj"), config.n_kv_heads)  # [B, Hkv, T, D]
    v = split_heads(project(h, w, p + "self_attn.v_proj"), config.n_kv_heads)  # [B, Hkv, T, D]
    if p + "self_attn.q_norm.weight" in w:  # Qwen3 normalises each head before RoPE
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
    q, k = rope(q, *rope_cs), rope(k, *rope_cs)
    x = x + project(merge_heads(attend(i, q, k, v)), w, p + "self_attn.o_proj")
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = project(h, w, p + "mlp.gate_proj"), project(h, w, p + "mlp.up_proj")
    return x + project(F.silu(gate) * up, w, p + "mlp.down_proj")


def embed(ids, w):  # [B, T] -> [B, T, D]
    return w["model.embed_tokens.weight"][ids]


def embed_at(ids, w, config, positions):
    """The inputs of the first block for ids `[B, T]` at `positions` (`[T]` or `[B, T]`): `[B, T, D]`, and
    what every block needs of the positions: the rotary tables (cos, sin), computed once per forward."""
    x = embed(ids, w)
    return x, (rope_tables(positions, config.head_dim, config.rope_theta, x.dtype),)


def head(x, w, config):  # [B, T, D] -> [B, T, V]
    x = rms_norm(x, w["model.norm.weight"], config.norm_eps)
    if "lm_head" in getattr(w, "packed", {}):
        return project(x, w, "lm_head")
    return F.linear(x, w.get("lm_head.weight", w["model.embed_tokens.weight"]))


def causal_attention(i, q, k, v):  # grouped-query: a KV head serves n_heads / n_kv_heads queries
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def forward(ids, w, config, last_only=False):
    """Uncached forward: logits `[B, T, V]` for ids `[B, T]` (`[B, 1, V]` with last_only)."""
    ids = check_ids(ids, config)
    positions = torch.arange(ids.shape[1], device=ids.device)
    x = embed(ids, w)
    rope_cs = rope_tables(positions, config.head_dim, config.rope_theta, x.dtype)
    for i in range(config.n_layers):
        x = block(x, w, i, config, causal_attention, rope_cs)
    return head(x[:, -1:] if last_only else x, w, config)
