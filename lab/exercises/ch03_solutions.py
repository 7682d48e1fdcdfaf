"""Reference solutions for chapter 3 (the tests run the checks on these)."""


def _parts(c, T):
    D, hd, Hq, Hkv = c.d_model, c.head_dim, c.n_heads, c.n_kv_heads
    projections = 2 * (D * Hq * hd + 2 * D * Hkv * hd + Hq * hd * D)  # q, k, v, o
    mlp = 2 * (3 if c.arch == "llama" else 2) * D * c.d_ff             # gate, up, down (GPT-2: fc, proj)
    attention = 2 * 2 * Hq * hd * (T + 1)                              # q k^T and weights v over T+1 keys
    return projections + mlp, attention


def decode_flops(config, T):
    dense, attention = _parts(config, T)
    return config.n_layers * (dense + attention) + 2 * config.d_model * config.vocab_size


def attention_share(config, T):
    return config.n_layers * _parts(config, T)[1] / decode_flops(config, T)
