"""Chapter 4 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut."""

import pytest


def test_ch04_prefix_store_check():
    from lab.exercises import ch04
    from lab.exercises import ch04_solutions as sol4

    assert ch04.check_prefix_store(sol4.LRUPrefixStore) > 0.25

    class IgnoresIdentity(sol4.LRUPrefixStore):  # serves another tenant's state: must be caught
        def lookup(self, identity, ids):
            for key, (_, stored, cache) in self.entries.items():
                self.entries[key] = (identity, stored, cache)
            return super().lookup(identity, ids)

    class NeverStores:
        def __init__(self, capacity):
            pass

        def lookup(self, identity, ids):
            return None, 0

        def insert(self, identity, ids, cache):
            pass

    with pytest.raises(AssertionError, match="only 0"):
        ch04.check_prefix_store(NeverStores)
    with pytest.raises(AssertionError, match="another tenant|differ from recomputation"):
        ch04.check_prefix_store(IgnoresIdentity)
