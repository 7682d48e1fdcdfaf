"""The Llama family (SmolLM2, Llama, Qwen2/3) as a function of (ids, weights, config).

Differences from GPT-2: RMSNorm instead of LayerNorm, rotary position embeddings (RoPE) applied to queries and keys
instead of a learned position table, grouped-query attention (fewer key/value heads than query heads), and a gated
SiLU MLP. Weights keep their Hugging Face names; nn.Linear stores `[out, in]`, so projections are `F.linear(x, W)`.
"""

import torch
import torch.nn.functional as F

from ..kernels import fused
from ..kernels.cpu import cpu_kernel_available
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


def project(h, w, *names):
    """The linear layers `names` applied to h `[B, T, D_in]` (with their biases when the checkpoint has them,
    as Qwen2's q, k, v do): one tensor for one name, a tuple for several. Prepacked weights hold several
    as one merged matrix: one product instead of three (q, k, v) or two (gate, up)."""
    packed = getattr(w, "packed", {}).get(names)                   # see Prepacked, for CPU serving
    if packed is not None:
        out = torch.ops.mkldnn._linear_pointwise(h, packed, w.biases[names], "none", [], "")
        return out if len(names) == 1 else out.split(w.widths[names], dim=-1)
    outs = tuple(F.linear(h, w[n + ".weight"], w.get(n + ".bias")) for n in names)
    return outs[0] if len(names) == 1 else outs


class Prepacked(dict):
    """The same weights, each projection also held in oneDNN's blocked layout (`packed[names]`), as vLLM's
    CPU backend holds them, with q, k, v merged into one matrix and gate, up into another. A product with
    few rows (a decode step's) is bound by reading the weights, and `F.linear` repacks each weight on every
    call; the packed copy is read as it lies, and a merged product makes one pass where there were three.
    lab/experiments/ch08_serving.py measures the gain. The dict's tensors are the model's own, so `owner`
    and the manifest see the same state; the copies cost the weights' memory again."""

    MERGED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
              ("self_attn.o_proj",), ("mlp.down_proj",))

    def __init__(self, weights: dict, rows: int = 16):
        super().__init__(weights)
        layers = sorted({n.split(".")[2] for n in weights if n.startswith("model.layers.")}, key=int)
        groups = [tuple(f"model.layers.{i}.{n}" for n in names) for i in layers for names in self.MERGED]
        self.packed, self.biases, self.widths = {}, {}, {}
        for names in groups:
            matrix = torch.cat([weights[n + ".weight"] for n in names])          # [sum of outs, D_in]
            self.packed[names] = torch.ops.mkldnn._reorder_linear_weight(matrix, rows)
            self.biases[names] = (torch.cat([weights[n + ".bias"] for n in names])
                                  if names[0] + ".bias" in weights else None)
            self.widths[names] = [weights[n + ".weight"].shape[0] for n in names]
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self.packed[("lm_head",)] = torch.ops.mkldnn._reorder_linear_weight(head, rows)
        self.biases[("lm_head",)], self.widths[("lm_head",)] = None, [head.shape[0]]
        # the layer that runs them (forward_cached takes it): fused where the C++ operations build
        self.block = fused_block if cpu_kernel_available() and not any("q_norm" in n for n in weights) else block

    @staticmethod
    def applies(weights: dict) -> bool:
        """float32 on a CPU with oneDNN, or bfloat16 where oneDNN runs it natively (AVX-512 BF16 or AMX)."""
        t = next(iter(weights.values()))
        if not torch.backends.mkldnn.is_available() or t.device.type != "cpu":
            return False
        return t.dtype == torch.float32 or t.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def block(x, w, i, config, attend, rope_cs):
    """One decoder layer. `attend(i, q, k, v)` is layer i's attention on q `[B, Hq, T, D]` and
    k, v `[B, Hkv, T, D]`; rope_cs = (cos, sin), each `[T, D]`, from `rope_tables`."""
    p, eps = f"model.layers.{i}.", config.norm_eps
    h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
    q, k, v = project(h, w, p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj")
    q = split_heads(q, config.n_heads)                                         # [B, Hq, T, D]
    k, v = split_heads(k, config.n_kv_heads), split_heads(v, config.n_kv_heads)  # [B, Hkv, T, D]
    if p + "self_attn.q_norm.weight" in w:  # Qwen3 normalises each head before RoPE
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
    q, k = rope(q, *rope_cs), rope(k, *rope_cs)
    x = x + project(merge_heads(attend(i, q, k, v)), w, p + "self_attn.o_proj")
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = project(h, w, p + "mlp.gate_proj", p + "mlp.up_proj")
    return x + project(F.silu(gate) * up, w, p + "mlp.down_proj")


def fused_block(x, w, i, config, attend, rope_cs):
    """`block` as the serving engine runs it with `Prepacked` weights on the CPU: the same
    arithmetic in fewer calls (lab/kernels/fused.py). rope_cs: cos, sin `[T, D]`."""
    if x.shape[0] != 1 or rope_cs[0].dim() != 2:     # one row of tokens (a serving step); else the reference
        return block(x, w, i, config, attend, rope_cs)
    p, eps = f"model.layers.{i}.", config.norm_eps
    _, h = fused.add_rms_norm(x, w[p + "input_layernorm.weight"], eps)
    q, k, v = project(h, w, p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj")
    fused.rope_(q, *rope_cs, config.n_heads), fused.rope_(k, *rope_cs, config.n_kv_heads)
    q = split_heads(q, config.n_heads)                                         # [B, Hq, T, D]
    k, v = split_heads(k, config.n_kv_heads), split_heads(v, config.n_kv_heads)  # [B, Hkv, T, D]
    out = project(merge_heads(attend(i, q, k, v)), w, p + "self_attn.o_proj")
    x, h = fused.add_rms_norm(x, w[p + "post_attention_layernorm.weight"], eps, add=out)
    gate, up = project(h, w, p + "mlp.gate_proj", p + "mlp.up_proj")
    return x + project(fused.silu_mul(gate, up), w, p + "mlp.down_proj")


def embed(ids, w):  # [B, T] -> [B, T, D]
    return w["model.embed_tokens.weight"][ids]


def embed_at(ids, w, config, positions):
    """The inputs of the first block for ids `[B, T]` at `positions` (`[T]` or `[B, T]`): `[B, T, D]`, and
    what every block needs of the positions: the rotary tables (cos, sin), computed once per forward."""
    x = embed(ids, w)
    return x, (rope_tables(positions, config.head_dim, config.rope_theta, x.dtype),)


def head(x, w, config):  # [B, T, D] -> [B, T, V]
    x = rms_norm(x, w["model.norm.weight"], config.norm_eps)
    if ("lm_head",) in getattr(w, "packed", {}):
        return project(x, w, "lm_head")
    return F.linear(x, w.get("lm_head.weight", w["model.embed_tokens.weight"]))


def causal_attention(i, q, k, v):  # grouped-query: a KV head serves n_heads / n_kv_heads queries
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def forward(ids, w, config, last_only=False):
    """Uncached forward: logits `[B, T, V]` for ids `[B, T]` (`[B, 1, V]` with last_only)."""
    ids = check_ids(ids, config)
    x, (rope_cs,) = embed_at(ids, w, config, torch.arange(ids.shape[1], device=ids.device))
    for i in range(config.n_layers):
        x = block(x, w, i, config, causal_attention, rope_cs)
    return head(x[:, -1:] if last_only else x, w, config)
