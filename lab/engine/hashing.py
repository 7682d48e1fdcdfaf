"""Names for pages of a prefix (chapter 6 explains them): one digest per full page, chained, as engines name them.
Digest i hashes digest i - 1 and page i's own tokens, from a root that hashes `extra` (the identity and the salt);
a partial last page has no digest (its positions are not final, so it is never shared).
"""

import torch

from ..cache import checks
from ..cache.hashing import page_keys, root_digest  # noqa: F401  (re-exported)
from .identity import token_ids


def block_hashes(ids, page_size: int, extra=()) -> list[str]:
    """One hex digest per full page of `ids` (a list, `[T]` or `[1, T]`): len(ids) // page_size of
    them, `page_keys`'s digests in hex. digest_i = page_digest(digest_{i-1}, ids of page i),
    digest_{-1} = root_digest(extra) (lab.cache.hashing: sha256 of the parent and the ids as
    little-endian int64)."""
    checks.int_arg("page_size", page_size, low=1)
    if (ids.numel() if isinstance(ids, torch.Tensor) else len(ids)) == 0:
        return []                                                 # no token, no page
    return [digest.hex() for digest, _, _ in page_keys(token_ids(ids).tolist(), page_size, extra)]
