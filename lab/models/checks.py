"""Input checks shared by the forwards: a clear error instead of an index error deep inside torch."""

import torch

from ..kernels.cpu import sample_runs


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


def check_positions(positions, config) -> None:
    """Positions given explicitly to a forward (`[T]` or `[B, T]`) lie inside the model's context: the
    same PositionLimitError as ids past it. On a GPU, reading the largest back waits for the device."""
    last = int(positions.max()) if positions.numel() else -1
    if last >= config.max_positions:
        what = "learned position table" if config.arch == "gpt2" else "trained context (max_position_embeddings)"
        raise PositionLimitError(f"position {last} is past {config.name or config.arch}'s {what} of "
                                 f"{config.max_positions} positions (0 .. {config.max_positions - 1})")


# region weights_fingerprint
FINGERPRINT_SAMPLES = 64   # elements read per tensor: the cost is per tensor and per run
FINGERPRINT_RUN = 8        # consecutive elements per run: a run lies in one or two cache lines


def fingerprint(weights: dict) -> bytes:
    """The exact bytes of a strided sample of every tensor: FINGERPRINT_SAMPLES elements, in runs of
    FINGERPRINT_RUN consecutive ones evenly spaced over each tensor (all of a smaller one). A write
    that changes every element changes the sample, however it was made; one that changes only
    elements between the runs does not (chapter 4). Compared byte for byte (NaN included); on a GPU,
    reading the sample back waits for the device. On the CPU one C++ call reads every run
    (`sample_runs`); this loop is the same in PyTorch."""
    tensors = list(weights.values())
    fast = sample_runs(tensors, FINGERPRINT_SAMPLES, FINGERPRINT_RUN)
    if fast is not None:
        return fast
    samples, runs = [], FINGERPRINT_SAMPLES // FINGERPRINT_RUN
    with torch.inference_mode():
        for t in tensors:
            flat = t.reshape(-1)                           # a view, or a copy: rare for weights
            if t.numel() > FINGERPRINT_SAMPLES:                    # [runs, RUN], a view
                step = t.numel() // runs
                flat = flat.as_strided((runs, FINGERPRINT_RUN), (step, 1), flat.storage_offset())
            samples.append(flat.reshape(-1).view(torch.uint8).cpu())
        return torch.cat(samples).numpy().tobytes() if samples else b""
# endregion


def tensor_versions(weights: dict) -> tuple:
    """Which tensors, at which version: each one's storage address and version counter (about 50 us for
    272 tensors). Every ordinary in-place operation (`mul_`, `copy_`, an optimizer step) increments
    `_version`; another tensor, even an equal one, has another storage. Inference tensors have no
    version counter: they count as version 0."""
    return tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for t in weights.values())


def weights_state(weights: dict) -> tuple:
    """Which tensors, in which state: `tensor_versions`, and the `fingerprint` that sees writes they do not."""
    return tensor_versions(weights), fingerprint(weights)


def owner(weights: dict, config) -> tuple:
    """The identity a cache records for the model that fills it: its config and its weights' state.
    An identical copy of the weights (other tensors, equal values) is another owner: proving it
    equal would mean hashing every weight, so it is not assumed."""
    return config, weights_state(weights)
