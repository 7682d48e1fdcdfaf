"""Models: `load(name)`, and functional forwards for the GPT-2 and Llama families."""

from . import gpt2, llama
from .checks import InputError, check_ids
from .config import ModelConfig
from .load import KNOWN, Model, load, random_model


def forward(ids, weights, config, last_only=False):
    """Uncached forward, the oracle every cache is checked against: ids `[B, T]` -> logits `[B, T, V]`."""
    family = gpt2 if config.arch == "gpt2" else llama
    return family.forward(ids, weights, config, last_only=last_only)


__all__ = ["load", "forward", "Model", "ModelConfig", "InputError", "check_ids", "random_model", "KNOWN"]
