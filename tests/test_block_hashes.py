"""block_hashes: one chained digest per full page (the names prefix caching shares pages by).

Oracle: the definition recomputed independently with hashlib over the same bytes, and the properties a
chain must have (a page's digest depends on every token up to its end and on `extra`, never on later
tokens).
"""

import hashlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lab.cache import CacheInputError
from lab.engine import block_hashes, root_digest
from lab.models import InputError


def by_hand(ids, P, extra=()):
    parent, out = root_digest(extra), []
    for i in range(len(ids) // P):
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little", signed=True)
                                                  for t in ids[i * P:(i + 1) * P])).digest()
        out.append(parent.hex())
    return out


def test_one_digest_per_full_page_equal_to_the_definition():
    ids = list(range(100, 137))                                   # 37 tokens: 2 full pages of 16, 5 left over
    got = block_hashes(ids, 16, extra=("manifest", "salt"))
    assert len(got) == 2 and got == by_hand(ids, 16, ("manifest", "salt"))
    assert block_hashes(ids[:15], 16) == []                       # a partial page has no digest
    assert block_hashes(torch.tensor([ids]), 16, ("manifest", "salt")) == got   # [1, T] names the same pages


@given(ids=st.lists(st.integers(0, 50_000), min_size=1, max_size=120), P=st.sampled_from([1, 3, 16, 32]),
       where=st.integers(0, 119), data=st.data())
def test_an_edit_changes_its_page_and_every_later_one_only(ids, P, where, data):
    where %= len(ids)
    new = data.draw(st.integers(0, 50_000).filter(lambda t: t != ids[where]), label="new token")
    edited = ids[:where] + [new] + ids[where + 1:]
    a, b = block_hashes(ids, P), block_hashes(edited, P)
    page = where // P
    assert a[:page] == b[:page]                                   # pages before the edit keep their names
    assert all(x != y for x, y in zip(a[page:], b[page:], strict=True))   # the edited page and all after
    assert block_hashes(ids[:page * P], P) == a[:page]            # a page's name ignores later tokens


def test_extra_changes_every_digest():
    ids = list(range(64))
    base = block_hashes(ids, 16, extra=("manifest-a", None))
    for other in (("manifest-b", None), ("manifest-a", "tenant-b"), ()):
        assert all(x != y for x, y in zip(base, block_hashes(ids, 16, other), strict=True))


def test_bad_arguments_raise():
    with pytest.raises(CacheInputError, match="page_size"):
        block_hashes([1, 2, 3], 0)
    with pytest.raises(InputError):
        block_hashes([1.5, 2.0], 1)
