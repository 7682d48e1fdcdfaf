"""One config dataclass for both families the book uses (GPT-2 and Llama/Qwen)."""

from dataclasses import asdict, dataclass

import torch

DTYPES = ("float32", "bfloat16", "float16")  # what the forwards and caches run in: weights and activations


@dataclass(frozen=True)
class ModelConfig:
    arch: str                    # "gpt2" or "llama": which forward runs this model
    vocab_size: int = 50257      # GPT-2's BPE vocabulary
    n_layers: int = 12
    d_model: int = 768           # width of the residual stream
    n_heads: int = 12            # query heads
    n_kv_heads: int = 12         # key/value heads; fewer than n_heads is grouped-query attention
    head_dim: int = 64           # d_model // n_heads for every model here, but Qwen3 sets it apart
    d_ff: int = 3072             # MLP hidden width (4 * d_model for GPT-2)
    max_positions: int = 1024    # GPT-2's learned position table; RoPE models' trained context
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # RoPE base (Llama family only)
    tie_embeddings: bool = True  # the output head reuses the token embedding
    name: str = ""
    dtype: str = "float32"       # of the weights `load` gave; every cache stores this unless told otherwise
    # a cache shaped by the architecture (chapter 10, lab/models/retrofit.py); the defaults are the model as trained
    kv_rank: int = 0             # latent_kv: values cached per position per layer instead of keys and values
    kv_absorbed: bool = True     # ... attended in latent space (False: keys and values rebuilt every step)
    kv_share: int = 1            # share_kv: consecutive layers that read one cache, the lowest one's
    window: int = 0              # local_layers: positions a local layer sees (0: every layer is global)
    global_every: int = 1        # ... every global_every-th layer stays global (layers g-1, 2g-1, ...)
    sinks: int = 0               # ... first positions a local layer always sees (StreamingLLM's sinks)

    def __post_init__(self):
        if self.arch not in ("gpt2", "llama"):
            raise ValueError(f"arch must be 'gpt2' or 'llama', got {self.arch!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if not 0 <= self.kv_rank <= 2 * self.n_kv_heads * self.head_dim or self.kv_rank % 2:
            raise ValueError(f"kv_rank must be 0 or an even number up to 2 x kv_heads x head_dim = "
                             f"{2 * self.n_kv_heads * self.head_dim}, got {self.kv_rank}")
        if not 1 <= self.kv_share <= self.n_layers or not 1 <= self.global_every <= self.n_layers:
            raise ValueError(f"kv_share ({self.kv_share}) and global_every ({self.global_every}) must lie in "
                             f"1 .. n_layers ({self.n_layers})")
        if self.window < 0 or self.sinks < 0 or self.sinks and not self.window:
            raise ValueError(f"window and sinks must be at least 0, sinks only with a window; got window "
                             f"{self.window}, sinks {self.sinks}")

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head (1 = multi-head, n_heads = multi-query)."""
        return self.n_heads // self.n_kv_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def as_trained(self) -> bool:
        """No retrofit changes what the cache holds or what a layer attends to (chapter 10)."""
        return not self.kv_rank and self.kv_share == 1 and not (self.window and self.global_every > 1)

    @property
    def kv_layout(self) -> tuple:
        """What a cache holds per position: (layers, heads, dim) of the key tensor, the value tensor alike. As
        trained: (n_layers, n_kv_heads, head_dim); share_kv(every): one cache layer per `every` layers;
        latent_kv(rank): the keys' latent (rank / 2 values) in the key slot and the values' in the value slot, as
        one head, so every cache holds a latent model's cache as it holds any other."""
        layers = -(-self.n_layers // self.kv_share)
        return (layers, 1, self.kv_rank // 2) if self.kv_rank else (layers, self.n_kv_heads, self.head_dim)

    def kv_layer(self, i: int) -> int:
        """The cache layer model layer i reads (it writes it too when i % kv_share == 0)."""
        return i // self.kv_share

    def window_of(self, layer: int) -> tuple:
        """(window, sinks) of cache layer `layer`: (0, 0) when it is global. A layer is global when its
        index i has (i + 1) % global_every == 0; a layer that shares a cache follows the layer it reads."""
        i = layer * self.kv_share
        if not self.window or (i + 1) % self.global_every == 0:
            return 0, 0
        return self.window, self.sinks

    def kv_bytes_per_position(self, dtype=None) -> int:
        """Bytes a position occupies in a cache of `dtype` (the model's by default), as `kv_layout`
        counts them: SmolLM2 in bfloat16, 2 (K and V) x 30 x 3 x 64 x 2 = 23,040. A local layer's
        every position counts; `kv_bytes` counts a cache that frees what left the window."""
        size = torch.empty((), dtype=dtype or self.torch_dtype).element_size()
        layers, heads, dim = self.kv_layout
        return 2 * layers * heads * dim * size

    def kv_bytes(self, positions: int, dtype=None) -> int:
        """Bytes of one sequence of `positions` in a cache that keeps, for a local layer, only its
        window and sinks (at most window + sinks positions)."""
        layers, heads, dim = self.kv_layout
        per_layer = self.kv_bytes_per_position(dtype) // layers
        return sum(per_layer * (min(positions, w + s) if w else positions)
                   for w, s in map(self.window_of, range(layers)))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf(cls, hf: dict, name: str = "") -> "ModelConfig":
        """Read a Hugging Face config.json (GPT-2, Llama, Qwen2/3, SmolLM2)."""
        if hf.get("model_type") == "gpt2":
            d = hf["n_embd"]
            return cls(arch="gpt2", vocab_size=hf["vocab_size"], n_layers=hf["n_layer"], d_model=d,
                       n_heads=hf["n_head"], n_kv_heads=hf["n_head"], head_dim=d // hf["n_head"],
                       d_ff=hf.get("n_inner") or 4 * d, max_positions=hf["n_positions"],
                       norm_eps=hf.get("layer_norm_epsilon", 1e-5), tie_embeddings=True, name=name)
        if hf.get("model_type") in ("llama", "qwen2", "qwen3", "mistral"):
            rope = hf.get("rope_parameters") or {}
            theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
                raise NotImplementedError(f"{name}: only plain RoPE is implemented, not {rope or hf['rope_scaling']}")
            n_heads = hf["num_attention_heads"]
            return cls(arch="llama", vocab_size=hf["vocab_size"], n_layers=hf["num_hidden_layers"],
                       d_model=hf["hidden_size"], n_heads=n_heads,
                       n_kv_heads=hf.get("num_key_value_heads") or n_heads,
                       head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
                       d_ff=hf["intermediate_size"], max_positions=hf["max_position_embeddings"],
                       norm_eps=hf["rms_norm_eps"], rope_theta=float(theta),
                       tie_embeddings=hf.get("tie_word_embeddings", False), name=name)
        raise NotImplementedError(f"{name}: model_type {hf.get('model_type')!r} is not supported; "
                                  "the book implements the GPT-2 and Llama/Qwen families")

    def to_hf(self) -> dict:
        """The Hugging Face config.json for this config (used to build the transformers oracle)."""
        if self.arch == "gpt2":
            return dict(model_type="gpt2", vocab_size=self.vocab_size, n_layer=self.n_layers, n_embd=self.d_model,
                        n_head=self.n_heads, n_inner=self.d_ff, n_positions=self.max_positions,
                        layer_norm_epsilon=self.norm_eps, activation_function="gelu_new",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=None)
        return dict(model_type="llama", vocab_size=self.vocab_size, num_hidden_layers=self.n_layers,
                    hidden_size=self.d_model, num_attention_heads=self.n_heads,
                    num_key_value_heads=self.n_kv_heads, head_dim=self.head_dim,
                    intermediate_size=self.d_ff, max_position_embeddings=self.max_positions,
                    rms_norm_eps=self.norm_eps, rope_theta=self.rope_theta, hidden_act="silu",
                    tie_word_embeddings=self.tie_embeddings, attention_bias=False, mlp_bias=False,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
