"""The chained page digest prefix caching names pages by (computed here, where the pages live).

digest_i = sha256(digest_{i-1} || the page's token ids as little-endian int64), from `root_digest(extra)`, a hash
of the state identity and salt. `lab.engine.block_hashes` digests a whole sequence; the BlockManager checks a
registered page against its own.
"""

import hashlib
import json

import numpy as np


def root_digest(extra=()) -> bytes:
    """The chain's start: a sha256 over `extra`, a sequence of strings, numbers or objects with `digest()`."""
    parts = [x.digest() if hasattr(x, "digest") else x for x in extra]
    return hashlib.sha256(b"lab.block_hashes\0" + json.dumps(parts, default=repr).encode()).digest()


def page_digest(parent: bytes, tokens) -> bytes:
    """The digest of a page holding `tokens` (ints) whose predecessor's digest is `parent`."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<i8").tobytes()).digest()


def page_keys(ids: list, page_size: int, extra=(), known=()) -> list:
    """(digest, parent digest, tokens) of every full page of `ids` (a list), the digests as raw bytes:
    what the BlockManager registers a page under and checks a hit against. `known`, the keys of the
    leading pages already computed (for the same `extra`), is extended, not computed again."""
    P, keys = page_size, list(known)
    parent = keys[-1][0] if keys else root_digest(extra)
    for i in range(len(keys), len(ids) // P):
        page = ids[i * P:(i + 1) * P]
        digest = page_digest(parent, page)
        keys.append((digest, parent, page))
        parent = digest
    return keys
