"""Input checks shared by the forwards: a clear error instead of an index error deep inside torch."""

import torch


class InputError(ValueError):
    """Token ids that the model cannot take: wrong type, rank, dtype or values."""


class PositionLimitError(InputError):
    """Positions past the model's context: GPT-2's learned position table has no row for them, and a RoPE
    model (Llama family) was never trained there, so its scores would be silently degraded."""


def check_ids(ids, config, offset: int = 0) -> torch.Tensor:
    """Validate token ids `[batch, tokens]` for `config`; returns them as int64."""
    if not isinstance(ids, torch.Tensor):
        raise InputError(f"ids must be a torch.Tensor of shape [batch, tokens], got {type(ids).__name__}")
    if ids.dim() != 2:
        raise InputError(f"ids must have rank 2, [batch, tokens], got rank {ids.dim()} with shape "
                         f"{tuple(ids.shape)}; add a batch dimension with ids[None]")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise InputError(f"ids must be an integer tensor (torch.int64), got {ids.dtype}")
    if ids.numel() == 0:
        raise InputError(f"ids is empty (shape {tuple(ids.shape)}): at least one sequence of one token is needed")
    if offset + ids.shape[1] > config.max_positions:
        what = "learned position table" if config.arch == "gpt2" else "trained context (max_position_embeddings)"
        raise PositionLimitError(f"{offset + ids.shape[1]} positions exceed {config.name or config.arch}'s {what} "
                                 f"of {config.max_positions}")
    if ids.device.type == "cpu":
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= config.vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(f"token id {bad} is outside the vocabulary of {config.name or config.arch} "
                             f"(valid ids are 0 .. {config.vocab_size - 1})")
    else:  # reading the values back would make every step wait for the device: the device checks them
        torch._assert_async(((ids >= 0) & (ids < config.vocab_size)).all(),
                            f"a token id is outside the vocabulary 0 .. {config.vocab_size - 1}")
    return ids.long()


def weights_state(weights: dict) -> tuple:
    """Which tensors, in which state: each one's storage address and version counter (about 50 us for 272
    tensors). Every in-place operation (`mul_`, `copy_`, an optimizer step) increments `_version`; another
    tensor has another storage. Inference tensors have no version counter (they cannot be changed outside
    inference mode): they count as version 0."""
    return tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for t in weights.values())


def owner(weights: dict, config) -> tuple:
    """The identity a cache records for the model that fills it: its config and its weights' state."""
    return config, weights_state(weights)
