"""How many bytes a KV cache holds: 2 (K and V) x layers x kv_heads x head_dim x bytes per element."""


def bytes_per_position(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one token position occupies in the cache, over all layers, keys and values."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


def cache_bytes(config, tokens: int, batch_size: int = 1, dtype=None) -> int:
    """Bytes of a cache holding `tokens` positions for `batch_size` sequences of the model `config`, in
    `dtype` (the model's, as the caches store it, unless told otherwise)."""
    return batch_size * tokens * config.kv_bytes_per_position(dtype)
