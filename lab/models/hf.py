"""The transformers library's own model on the same weights: the independent oracle for parity."""

import torch


def to_transformers(model):
    """A transformers `*ForCausalLM` in eval mode holding exactly `model.weights` (same dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = dict(model.config.to_hf())
    model_type = hf_config.pop("model_type")
    config = AutoConfig.for_model(model_type, **hf_config)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():  # the library's own init must not move the caller's random stream
        hf = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    missing, unexpected = hf.load_state_dict(model.weights, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_embeddings)]
    if missing or unexpected:
        raise ValueError(f"weights do not match the transformers model: missing {missing}, unexpected {unexpected}")
    if model.config.tie_embeddings:
        hf.tie_weights()
    return hf.eval()
