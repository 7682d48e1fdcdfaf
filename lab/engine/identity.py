"""What a cached state is the state *of*: the model, the tokenizer, the cache, the positions, the ids.

A KV cache is correct only for the exact computation that produced it. `prefix_key` hashes everything
that computation depended on; two states are interchangeable only when their keys are equal.
"""

import hashlib
import json
from dataclasses import asdict, dataclass

import torch


class IdentityError(ValueError):
    """The identity of a model or state cannot be established (e.g. its manifest cannot be computed)."""


@dataclass(frozen=True)
class StateIdentity:
    """Everything but the token ids that a cached state depends on."""

    manifest: str            # sha256 of the weights and config
    tokenizer: str           # sha256 of the tokenizer (vocabulary, merges, rules) and chat template
    compute_dtype: str       # the dtype the forward ran in
    cache_dtype: str         # the dtype the keys and values are stored in
    cache_kind: str          # e.g. "ConcatCache", "StaticCache"
    rope_theta: float        # position configuration: RoPE base ...
    max_positions: int       # ... and the trained context length
    salt: str | None = None  # separates tenants: equal ids under another salt share no state

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def prefix_key(manifest: str, token_ids, *, tokenizer: str, compute_dtype="torch.float32",
               cache_dtype="torch.float32", cache_kind="ConcatCache", rope_theta=10000.0,
               max_positions=2048, salt=None) -> str:
    """sha256 over a state's identity and its exact token ids: change any input, the key changes."""
    identity = StateIdentity(manifest, tokenizer, str(compute_dtype), str(cache_dtype), cache_kind,
                             float(rope_theta), int(max_positions), salt)
    return key_for(identity, token_ids)


def key_for(identity: StateIdentity, token_ids) -> str:
    if not isinstance(token_ids, torch.Tensor):
        token_ids = list(token_ids)
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    h = hashlib.sha256(identity.digest().encode())
    h.update(f"{ids.numel()}:".encode())
    h.update(ids.numpy().tobytes())
    return h.hexdigest()


def identity_of(model, cache, salt=None) -> StateIdentity:
    """The identity a state computed now by `model` into `cache` would have."""
    manifest, tokenizer = model_identity(model)
    cfg = model.config
    return StateIdentity(manifest, tokenizer, str(model.dtype), str(cache.dtype),
                         type(cache).__name__, float(cfg.rope_theta), int(cfg.max_positions), salt)


def model_identity(model) -> tuple:
    """(manifest, tokenizer hash) of a model, or IdentityError when either cannot be established."""
    try:
        manifest = model.manifest
    except Exception as e:  # a deleted weight file, an object without weights: never guess an identity
        raise IdentityError(f"cannot compute the manifest of model {getattr(model, 'name', model)!r}: {e}") from e
    tokenizer = getattr(getattr(model, "tokenizer", None), "sha256", None)
    if not isinstance(manifest, str) or not manifest or not tokenizer:
        raise IdentityError(f"model {getattr(model, 'name', model)!r} has no usable manifest or tokenizer hash")
    return manifest, tokenizer
