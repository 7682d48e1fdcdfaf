"""Retrofits: a new Model from an old one, which every cache, backend and the engine accept.

Chapter 10 shapes the cache from inside the model, without training: fewer key/value heads (`pool_kv_heads`), a
latent per token instead of keys and values (`latent_kv`), layers that see only a window (`local_layers`) and
layers that read a lower layer's cache (`share_kv`), each by setting config fields the caches apply. `block` is the
layer every cached forward runs for a retrofitted model; `forward` is its uncached oracle.
"""

import dataclasses

import torch
import torch.nn.functional as F

from .checks import check_ids
from .gpt2 import merge_heads, split_heads
from .llama import embed_at, head, project, rms_norm, rope, rope_tables
from .load import Model

OUTLIER_FACTOR, OUTLIER_PAIRS = 16.0, (3,)


class RetrofitError(ValueError):
    """A retrofit's setting that does not fit the model (a rank above the head dimensions, a window < 1)."""


def bases(w, layer: int) -> tuple:
    """U_k, U_v `[kv_heads x head_dim, rank / 2]`: the orthonormal bases of cache layer `layer`'s latent."""
    return w[f"model.layers.{layer}.self_attn.k_latent"], w[f"model.layers.{layer}.self_attn.v_latent"]


def to_latent(x, U):
    """A latent per position: c = U^T x, x the keys (after RoPE) or values of every KV head.
    x `[B, H_kv, T, D]` -> `[B, 1, T, r/2]`."""
    B, H, T, D = x.shape
    return (x.transpose(1, 2).reshape(B, T, H * D) @ U)[:, None]


def from_latent(c, U, H):
    """Keys or values back from their latent: x = U c. c `[B, 1, T, r/2]` -> `[B, H_kv, T, D]`."""
    B, _, T, _ = c.shape
    return (c[:, 0] @ U.T).view(B, T, H, -1).transpose(1, 2)


def absorb_query(q, U_k, config):
    """The query in latent space (the absorbed form): q_h . k = q_h . U_k,g c = (U_k,g^T q_h) . c,
    for query head h of KV group g. q `[B, H_q, T, D]` -> `[B, H_q, T, r/2]`, scaled so that
    attention's 1/sqrt(r/2) becomes the model's 1/sqrt(D)."""
    H, D, r = config.n_kv_heads, config.head_dim, U_k.shape[1]
    per_head = U_k.view(H, D, r).repeat_interleave(config.group_size, dim=0)      # [H_q, D, r/2]
    return (q @ per_head) * (r / D) ** 0.5


def expand_output(o, U_v, config):
    """An output in latent space back to each head's values:
    sum_t p_t U_v,g c_t = U_v,g (sum_t p_t c_t). o `[B, H_q, T, r/2]` -> `[B, H_q, T, D]`."""
    H, D, r = config.n_kv_heads, config.head_dim, U_v.shape[1]
    per_head = U_v.view(H, D, r).repeat_interleave(config.group_size, dim=0)      # [H_q, D, r/2]
    return o @ per_head.transpose(1, 2)


def block(x, w, i, config, attend, rope_cs):
    """One decoder layer of a retrofitted model, as every cache runs it: layer i reads cache layer
    config.kv_layer(i), and stores into it only when it is the lowest of the layers that share it. A
    latent model attends in latent space (absorbed); the cache applies the window."""
    p, eps = f"model.layers.{i}.", config.norm_eps
    h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
    j, stores = config.kv_layer(i), i % config.kv_share == 0
    q, k, v = attention_inputs(h, w, i, config, rope_cs, stores)
    if config.kv_rank:                                      # the latents of cache layer j
        U_k, U_v = bases(w, j * config.kv_share)            # [H_kv D, r/2] each
        if stores:
            k, v = to_latent(k, U_k), to_latent(v, U_v)     # [B, 1, T, r/2]: what the cache holds
        if config.kv_absorbed:                              # attention in latent space, like MQA
            o = expand_output(attend(j, absorb_query(q, U_k, config), k, v), U_v, config)
        else:                                               # rebuild every key and value, every step
            o = reconstructing(attend(j, None, k, v), q, U_k, U_v, j, config)
    else:
        o = attend(j, q, k, v)                              # k = v = None: read layer j's cache
    x = x + project(merge_heads(o), w, p + "self_attn.o_proj")
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = project(h, w, p + "mlp.gate_proj", p + "mlp.up_proj")
    return x + project(F.silu(gate) * up, w, p + "mlp.down_proj")


def attention_inputs(h, w, i, config, rope_cs, stores):
    """q `[B, H_q, T, D]`, and k, v `[B, H_kv, T, D]` when layer i stores (else None), after RoPE."""
    p, eps = f"model.layers.{i}.", config.norm_eps
    names = ("q_proj", "k_proj", "v_proj") if stores else ("q_proj",)
    out = project(h, w, *(p + "self_attn." + n for n in names))
    q, k, v = (out, None, None) if not stores else out
    q = split_heads(q, config.n_heads)
    if p + "self_attn.q_norm.weight" in w:               # Qwen3 normalises each head before RoPE
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
    q = rope(q, *rope_cs)
    if stores:
        k, v = split_heads(k, config.n_kv_heads), split_heads(v, config.n_kv_heads)
        if p + "self_attn.k_norm.weight" in w:
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        k = rope(k, *rope_cs)
    return q, k, v


def reconstructing(latents, q, U_k, U_v, layer, config):
    """Attention of q `[B, H_q, T, D]` over keys and values rebuilt from a cache layer's latents (`[B, 1, L,
    r/2]` each): the reconstructing form, which multiplies every cached position by U at every step, where
    the absorbed form multiplies the queries and the output only."""
    k, v = (from_latent(c, U, config.n_kv_heads) for c, U in zip(latents, (U_k, U_v), strict=True))
    T, L = q.shape[2], k.shape[2]
    mask = sees(L - T, T, *config.window_of(layer), device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def sees(start, T, window=0, sinks=0, device=None):
    """`[T, start + T]` bool: query start + i sees key j when j <= start + i and, in a local layer, j is one of
    the last `window` positions or the first `sinks`. (The caches build the same mask in lab/cache/base.py;
    the models keep their own, so that the oracle shares no code with what it checks.)"""
    i = torch.arange(start, start + T, device=device)[:, None]
    j = torch.arange(start + T, device=device)[None, :]
    return (j <= i) & ((window == 0) | (i - j < window) | (j < sinks))


def forward(ids, w, config, last_only=False, held=None):
    """The uncached oracle of a retrofitted model: logits `[B, T, V]` for ids `[B, T]`, written apart from `block`
    (latents turned back into keys and values, sharing layers read their source's keys, local layers mask their
    window). `held`, a dict, receives each cache layer's keys (after RoPE) and values `[B, H_kv, T, D]`."""
    ids = check_ids(ids, config)
    T = ids.shape[1]
    x, (rope_cs,) = embed_at(ids, w, config, torch.arange(T, device=ids.device))
    held = {} if held is None else held                     # cache layer -> (k, v) of this call
    for i in range(config.n_layers):
        p, eps = f"model.layers.{i}.", config.norm_eps
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        j, stores = config.kv_layer(i), i % config.kv_share == 0
        q, k, v = attention_inputs(h, w, i, config, rope_cs, stores)
        if stores:
            if config.kv_rank:                              # through the latent and back
                U_k, U_v = bases(w, i)
                k, v = (from_latent(to_latent(x, U), U, config.n_kv_heads) for x, U in ((k, U_k), (v, U_v)))
            held[j] = k, v
        mask = sees(0, T, *config.window_of(j), device=ids.device)           # [T, T]
        o = F.scaled_dot_product_attention(q, *held[j], attn_mask=mask, enable_gqa=True)
        x = x + project(merge_heads(o), w, p + "self_attn.o_proj")
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = project(h, w, p + "mlp.gate_proj", p + "mlp.up_proj")
        x = x + project(F.silu(gate) * up, w, p + "mlp.down_proj")
    return head(x[:, -1:] if last_only else x, w, config)


def retrofitted(model, name: str, weights: dict | None = None, **fields) -> Model:
    """A new Model: the same tokenizer, these weights (the model's by default), the config with `fields`."""
    config = dataclasses.replace(model.config, name=f"{model.config.name or model.name}-{name}", **fields)
    layers = range(config.kv_layout[0])
    if config.window and config.global_every > 1 and all(config.window_of(j)[0] for j in layers):
        raise RetrofitError(f"local layers every {config.global_every} with layers shared by {config.kv_share} "
                            "leave no global layer: a layer that shares a cache follows the layer it reads")
    return Model(f"{model.name}-{name}", config, dict(model.weights) if weights is None else weights,
                 model.tokenizer)


def llama_config(model):
    """The config of a Llama-family model (RoPE, grouped KV heads), which every retrofit takes."""
    if model.config.arch != "llama":
        raise RetrofitError(f"retrofits take a Llama-family model (RoPE, grouped KV heads), got {model.config.arch}")
    return model.config


def count(what, n, low, high):
    """n is an int in low .. high, else a RetrofitError that says what was expected."""
    if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= high:
        raise RetrofitError(f"{what} must be an int in {low} .. {high}, got {n!r}")


def pool_kv_heads(model, kv_heads: int) -> Model:
    """Fewer key/value heads by mean-pooling neighbouring ones (the GQA paper's conversion before
    uptraining): each new head's key and value projections are the mean of the heads it replaces,
    and it serves all their queries. The model's own count returns the same function."""
    cfg = llama_config(model)
    count("kv_heads", kv_heads, 1, cfg.n_kv_heads)
    if cfg.n_kv_heads % kv_heads:
        raise RetrofitError(f"kv_heads {kv_heads} must divide the model's {cfg.n_kv_heads} KV heads (and so its "
                            f"{cfg.n_heads} query heads): each new head is the mean of a group of old ones")
    if cfg.kv_rank or cfg.kv_share > 1:
        raise RetrofitError("pool_kv_heads comes before latent_kv and share_kv")
    weights, m = dict(model.weights), cfg.n_kv_heads // kv_heads
    kv = tuple(f"self_attn.{x}_proj.{part}" for x in "kv" for part in ("weight", "bias"))
    for name, t in model.weights.items():
        if name.endswith(kv):                       # [H_kv * D, d_model] (a bias: [H_kv * D])
            weights[name] = t.view(kv_heads, m, cfg.head_dim, *t.shape[1:]).mean(1).flatten(0, 1)
    return retrofitted(model, f"kv{kv_heads}", weights, n_kv_heads=kv_heads)


def latent_kv(model, rank: int, calibration_ids) -> Model:
    """A latent of `rank` values per position and layer instead of keys and values (MLA-style, without training,
    chapter 10): rank / 2 for keys, rank / 2 for values. U_k holds the top principal directions of each layer's
    keys after RoPE, U_v of its values, on `calibration_ids` (a list of id sequences); the cache holds c_k = U_k^T
    k and c_v = U_v^T v, and attention runs in latent space, q . k = (U_k^T q) . c_k (`block`). rank = 2 x kv_heads
    x head_dim reproduces the model."""
    check_latent(model, rank)                                   # before the calibration's forwards
    return latent_from_moments(model, rank, calibration_moments(model, calibration_ids))


def latent_from_moments(model, rank: int, moments: dict) -> Model:
    """latent_kv from the calibration's moments (`calibration_moments`), computed once for several ranks."""
    cfg = check_latent(model, rank)
    weights = dict(model.weights)
    for j, pair in moments.items():
        for name, m in zip(("k_latent", "v_latent"), pair, strict=True):   # [H_kv D, H_kv D] each
            _, vectors = torch.linalg.eigh(m)                                  # ascending eigenvalues
            U = vectors[:, -(rank // 2):].flip(-1)                             # the largest first
            weights[f"model.layers.{j * cfg.kv_share}.self_attn.{name}"] = U.to(cfg.torch_dtype).contiguous()
    return retrofitted(model, f"latent{rank}", weights, kv_rank=rank)


def check_latent(model, rank):
    """A rank latent_kv can take for this model: even, 1 .. 2 x kv_heads x head_dim; the config."""
    cfg = llama_config(model)
    count("rank", rank, 1, 2 * cfg.n_kv_heads * cfg.head_dim)
    if rank % 2:
        raise RetrofitError(f"rank must be even: half of it for the keys, half for the values; got {rank}")
    if cfg.kv_rank:
        raise RetrofitError("the model holds a latent already")
    return cfg


@torch.inference_mode()
def calibration_moments(model, calibration_ids, before_rope: bool = False) -> dict:
    """{cache layer: (K^T K, V^T V)} in float64 over every position of `calibration_ids`, keys after RoPE (before
    it with `before_rope`: each key turned back by its angles), every KV head side by side `[H_kv D, H_kv D]`."""
    if isinstance(calibration_ids, torch.Tensor):
        calibration_ids = calibration_ids.tolist() if calibration_ids.dim() == 2 else [calibration_ids.tolist()]
    seqs = list(calibration_ids) if isinstance(calibration_ids, (list, tuple)) else []
    if not seqs or not all(isinstance(s, (list, tuple)) and s for s in seqs):
        raise RetrofitError("calibration_ids must be a non-empty list of non-empty id sequences (lists of ints)")
    moments = {}
    for s in seqs:
        held = {}
        forward(torch.tensor([list(s)]), model.weights, model.config, last_only=True, held=held)
        if before_rope:                                 # RoPE is a rotation: the opposite angles undo it
            cos, sin = rope_tables(torch.arange(len(s)), model.config.head_dim, model.config.rope_theta, torch.float32)
            held = {j: (rope(k, cos, -sin), v) for j, (k, v) in held.items()}
        for j, kv in held.items():
            x = [t[0].transpose(0, 1).flatten(1).double() for t in kv]          # [T, H_kv D] each
            moments[j] = tuple(o + a.T @ a for o, a in zip(moments.get(j, (0, 0)), x, strict=True))
    return moments


def local_layers(model, window: int, global_every: int, sinks: int = 0) -> Model:
    """Layers that see only the last `window` positions (their own included) and the first `sinks`, as
    Gemma's and gpt-oss's local layers do (sinks as StreamingLLM keeps them); layers g-1, 2g-1, ... with
    g = global_every stay global. A window at least the context, or global_every = 1, is the model."""
    cfg = llama_config(model)
    count("window", window, 1, 1 << 40)
    count("global_every", global_every, 1, cfg.n_layers)
    count("sinks", sinks, 0, 1 << 40)
    if cfg.window and cfg.global_every > 1:
        raise RetrofitError("the model has local layers already")
    return retrofitted(model, f"local{window}g{global_every}" + (f"s{sinks}" if sinks else ""),
                       window=window, global_every=global_every, sinks=sinks)


def reconstructing_form(model) -> Model:
    """The same latent model, decoding in the reconstructing form: each step rebuilds keys and values
    from every cached latent (what an engine does for a long prefill), where `block` absorbs U into the
    queries. The same function; a step's cost grows with the positions times the rank."""
    if not model.config.kv_rank:
        raise RetrofitError("reconstructing_form takes a latent model (latent_kv)")
    return Model(f"{model.name}-reconstructing", dataclasses.replace(model.config, kv_absorbed=False),
                 model.weights, model.tokenizer)


def share_kv(model, every: int = 2) -> Model:
    """Cross-layer attention (CLA) without training: each run of `every` layers reads one cache, the one
    its lowest layer writes; the others' own key and value projections go unused. every = 1 is the model."""
    cfg = llama_config(model)
    count("every", every, 1, cfg.n_layers)
    if cfg.kv_share > 1 or cfg.kv_rank:
        raise RetrofitError("share_kv takes a model that does not share or hold a latent yet (apply it first)")
    return retrofitted(model, f"share{every}", kv_share=every)


def with_outlier_channels(model, factor=OUTLIER_FACTOR, pairs=OUTLIER_PAIRS):
    """The same function with keys that have outlier channels: in every layer and KV head, the key projection's
    rows for channels i and i + D/2 (a RoPE pair) times `factor`, the matching query rows divided by it. q . k is
    unchanged (exactly, for a power of two); the keys' range is not."""
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
