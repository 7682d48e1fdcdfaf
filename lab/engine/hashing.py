"""Names for pages of a prefix: one digest per full page, chained, as prefix-caching engines compute them.

Page i of a sequence holds positions i*P .. i*P + P - 1. Its keys and values depend on every token before
it and on everything chapter 4's state identity covers (model, tokenizer, dtypes, positions, salt), so its
name must too. Chaining does that cheaply: digest i hashes digest i - 1 and page i's own tokens, and the
chain starts from a root that hashes `extra` (the identity and the salt). Change a token in page i and
digests i, i + 1, ... change, none before; change the salt or the model and every digest changes. A partial
last page has no digest: its positions are not final, so it is never shared.
"""

import hashlib

import torch

from ..cache import checks
from ..cache.hashing import root_digest
from .identity import token_ids


def block_hashes(ids, page_size: int, extra=()) -> list[str]:
    """One hex digest per full page of `ids` (a list, `[T]` or `[1, T]`): `len(ids) // page_size` of them.

    digest_i = sha256(digest_{i-1} || ids of page i as little-endian int64), digest_{-1} = root_digest(extra)
    (lab.cache.hashing.page_digest, computed here over one buffer of all the ids).
    """
    checks.int_arg("page_size", page_size, low=1)
    if (ids.numel() if isinstance(ids, torch.Tensor) else len(ids)) == 0:
        return []                                                 # no token, no page
    raw = token_ids(ids).numpy().astype("<i8").tobytes()         # 8 bytes a token
    parent, out = root_digest(extra), []
    for i in range(len(raw) // (8 * page_size)):
        h = hashlib.sha256(parent)
        h.update(raw[8 * page_size * i: 8 * page_size * (i + 1)])
        parent = h.digest()
        out.append(h.hexdigest())
    return out
