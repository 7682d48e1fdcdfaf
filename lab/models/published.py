"""Shapes of real models, from each model's published config.json (sources in research/ch01/sources.md)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedShape:
    name: str
    n_layers: int      # num_hidden_layers / n_layer
    n_heads: int       # query heads: num_attention_heads / n_head
    n_kv_heads: int    # num_key_value_heads (equal to n_heads for multi-head attention)
    head_dim: int      # head_dim, or hidden_size / num_attention_heads
    source: str        # the config.json it was read from


PUBLISHED = [
    PublishedShape("GPT-2 small", 12, 12, 12, 64, "https://huggingface.co/openai-community/gpt2/blob/main/config.json"),
    PublishedShape("SmolLM2-135M", 30, 9, 3, 64,
                   "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json"),
    PublishedShape("Qwen3-0.6B", 28, 16, 8, 128, "https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json"),
    PublishedShape("Qwen3-4B", 36, 32, 8, 128, "https://huggingface.co/Qwen/Qwen3-4B/blob/main/config.json"),
    PublishedShape("Llama-2-13B", 40, 40, 40, 128,
                   "https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json"),
]
