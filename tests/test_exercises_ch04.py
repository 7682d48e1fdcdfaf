"""Chapter 4 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

The prefix store's rule has three parts, and each has a shortcut that the check must catch: a state is
offered only under its own identity (model, dtype, tenant), only for ids that extend its own ids, and
the store must actually keep states (a store that never stores is always correct and useless).
"""

import pytest

from lab import results
from lab.exercises import ch04
from lab.exercises import ch04_solutions as sol


def test_ch04_prefix_store_check():
    assert ch04.check_prefix_store(sol.LRUPrefixStore) > 0.25


class IgnoresIdentity(sol.LRUPrefixStore):
    """Serves whatever state shares the ids, under any identity (another tenant's, another model's)."""

    def lookup(self, identity, ids):
        for key, (_, stored, cache) in self.entries.items():
            self.entries[key] = (identity, stored, cache)
        return super().lookup(identity, ids)


class IgnoresTheModel(sol.LRUPrefixStore):
    """Keeps tenants apart (compares the salt) but not models: serves the base model's state to a
    fine-tuned variant with the same shapes."""

    def lookup(self, identity, ids):
        for key, (ident, stored, cache) in self.entries.items():
            if ident.salt == identity.salt:
                self.entries[key] = (identity, stored, cache)
        return super().lookup(identity, ids)


class LengthOnly(sol.LRUPrefixStore):
    """Serves a non-prefix: the most recent state of this identity, cropped to the shorter length, without
    comparing the ids."""

    def lookup(self, identity, ids):
        for ident, stored, cache in reversed(self.entries.values()):
            if ident == identity:
                n = min(len(stored), len(ids) - 1)
                state = cache.fork()
                state.crop(n)
                return state, n
        return None, 0


class Uncropped(sol.LRUPrefixStore):
    """Finds the right common prefix but hands back the whole stored state, longer than it says."""

    def lookup(self, identity, ids):
        cache, n = super().lookup(identity, ids)
        if cache is None:
            return None, 0
        for ident, stored, full in self.entries.values():
            if ident == identity and stored[:n] == list(ids[:n]):
                return full.fork(), n
        return cache, n


class NeverStores:
    def __init__(self, capacity):
        pass

    def lookup(self, identity, ids):
        return None, 0

    def insert(self, identity, ids, cache):
        pass


@pytest.mark.parametrize("store, message", [
    (IgnoresIdentity, "another tenant"),
    (IgnoresTheModel, "computed by another model"),  # passes the tenant rule, serves the base model's state
    (LengthOnly, "common prefix"),
    (Uncropped, "lookup returned n="),
    (NeverStores, "only 0"),
])
def test_ch04_prefix_store_refuses_a_store_that_breaks_a_rule(store, message):
    with pytest.raises(AssertionError, match=message):
        ch04.check_prefix_store(store)


@pytest.fixture
def book(tmp_path):
    """A results file with the book's key cost (the committed file gains it with the next full run)."""
    path = tmp_path / "results.json"
    results.write_section("ch04", {"key_cost_us": {"T512": results.value(50.0, "µs")}},
                          results.provenance(mode="full"), path=path)
    return path


def test_ch04_key_cost_check(book, capsys):
    # T = 512 keeps the test short; the reader's default is 4,096
    ratio = ch04.check_key_cost(sol.key_cost_us, T=512, path=book)
    assert ratio > 0 and "the book's" in capsys.readouterr().out


def test_ch04_key_cost_check_refuses_a_typed_number(book):
    with pytest.raises(AssertionError, match="do not type or look up a number"):
        ch04.check_key_cost(lambda T: 50.0, T=512, path=book)  # the book's number, not a measurement
