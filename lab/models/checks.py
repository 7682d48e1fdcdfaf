"""Input checks shared by the forwards: a clear error instead of an index error deep inside torch."""

import torch


class InputError(ValueError):
    """Token ids that the model cannot take: wrong type, rank, dtype or values."""


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
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= config.vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(f"token id {bad} is outside the vocabulary of {config.name or config.arch} "
                         f"(valid ids are 0 .. {config.vocab_size - 1})")
    if config.arch == "gpt2" and offset + ids.shape[1] > config.max_positions:
        raise InputError(f"{offset + ids.shape[1]} positions exceed GPT-2's learned position table "
                         f"of {config.max_positions}")
    return ids.long()
