"""What a cached state is the state *of* (chapter 4): `prefix_key` hashes everything the computation depended on;
two states are interchangeable only when their keys are equal.
"""

import hashlib
import json
import numbers
from collections.abc import Mapping, Set
from dataclasses import asdict, dataclass

import torch

from ..models.checks import InputError


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

    def __post_init__(self):
        check_salt(self.salt)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def prefix_key(manifest: str, token_ids, *, tokenizer: str, compute_dtype="torch.float32",
               cache_dtype="torch.float32", cache_kind="ConcatCache", rope_theta=10000.0,
               max_positions=2048, salt=None) -> str:
    """sha256 over a state's identity and its exact token ids: change any input, the key changes."""
    identity = StateIdentity(manifest, tokenizer, str(compute_dtype), str(cache_dtype), cache_kind,
                             float(rope_theta), int(max_positions), salt)
    return key_for(identity, token_ids)


def check_salt(salt):
    """A salt is a string (a tenant's name, a secret) or None. Anything else is refused, never str()-ed:
    5 and "5" would otherwise name the same state, and bytes would name another one than their text."""
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"salt must be a string or None, got {type(salt).__name__} {salt!r}")


def token_ids(ids, vocab_size: int | None = None) -> torch.Tensor:
    """One sequence of token ids, validated (a list of ints, `[T]` or `[1, T]` ints) -> int64 `[T]`. Refuses floats
    and bools (1.7 is not token 1), a batch of several sequences, negative ids, ids past int64, ids outside the
    vocabulary (given `vocab_size`), unordered containers (a set, a dict) and text (a string, bytes)."""
    if isinstance(ids, (Set, Mapping)):
        raise InputError(f"ids must be one sequence of token ids (a list, tuple or tensor), got a "
                         f"{type(ids).__name__}, whose order is not the caller's")
    if isinstance(ids, (str, bytes, bytearray)):
        raise InputError(f"ids must be token ids, got {type(ids).__name__}: encode text with the tokenizer first")
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise InputError(f"one sequence of ids is a list, [tokens] or [1, tokens]; got shape {tuple(ids.shape)}"
                             + (" (a batch of several sequences: call once per sequence)" if ids.dim() == 2 else ""))
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InputError(f"ids must be integers, got {ids.dtype}")
        t = ids.long().cpu()
    else:
        ids = list(ids)
        # the usual case, all Python ints, checked at C speed (70 us for 4,096 ids); anything else is looked at
        t = int64_ids(ids) if set(map(type, ids)) <= {int} else _unusual_ids(ids)
    if t.numel() == 0:
        raise InputError("ids is empty: at least one token is needed")
    lo, hi = (int(x) for x in torch.aminmax(t))
    if lo < 0 or vocab_size is not None and hi >= vocab_size:
        valid = f"0 .. {vocab_size - 1}" if vocab_size is not None else "non-negative"
        raise InputError(f"token id {lo if lo < 0 else hi} is outside the vocabulary (valid ids are {valid})")
    return t


def _unusual_ids(ids: list) -> torch.Tensor:
    """A list that is not all Python ints: one sequence given as [[...]], 0-d integer tensors, NumPy ints."""
    if ids and all(isinstance(i, (list, tuple)) for i in ids) and len(ids) == 1:
        ids = list(ids[0])                                   # [[1, 2, 3]]: one sequence as [1, T]
    if any(isinstance(i, (list, tuple)) for i in ids):
        raise InputError("one sequence of ids is a list, [tokens] or [1, tokens]; got a nested list "
                         "(a batch of several sequences: call once per sequence)")
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool)
               or isinstance(i, torch.Tensor) and i.dim() == 0 and not i.dtype.is_floating_point
               and i.dtype != torch.bool for i in ids):
        raise InputError(f"ids must be integers, got {[type(i).__name__ for i in ids][:5]}")
    return int64_ids([int(i) for i in ids])


def int64_ids(ids: list) -> torch.Tensor:
    """Python ints -> int64 `[T]`; an id past int64 (2**63) is outside every vocabulary, said so."""
    try:
        return torch.tensor(ids, dtype=torch.long)
    except (OverflowError, RuntimeError, ValueError):
        big = next(i for i in ids if not -2**63 <= i < 2**63)
        raise InputError(f"token id {big} is outside the vocabulary (it does not even fit in int64)") from None


def key_for(identity: StateIdentity, token_ids_) -> str:
    ids = token_ids(token_ids_)
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
