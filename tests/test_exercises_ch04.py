"""Chapter 4 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

The prefix store's rule has three parts, and each has a shortcut that the check must catch: a state is
offered only under its own identity (model, dtype, tenant), only for ids that extend its own ids, and
the store must actually keep states (a store that never stores is always correct and useless).
"""

import json
import time
from collections import OrderedDict

import pytest
import torch

from lab import results
from lab.cache import ConcatCache
from lab.exercises import ch04
from lab.exercises import ch04_solutions as sol
from lab.models import forward_cached, load
from lab.models.load import scaled_copy


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


class KeepsTensors:
    """Keeps every state it is given as plain tensors, no cache object kept, and builds a ConcatCache on lookup: no
    cache outlives the stream, and the capacity is never honoured (a reader's pass found the cache count alone
    passed it, with 45 hits of 48 at capacity 3)."""

    def __init__(self, capacity):
        self.entries = []

    def insert(self, identity, ids, cache):
        kv = [(k[..., :len(ids), :].clone(), v[..., :len(ids), :].clone())
              for k, v in zip(cache.keys, cache.values, strict=True)]
        self.entries.append((identity, list(ids), kv, cache.config))

    def lookup(self, identity, ids):
        best, n = None, 0
        for ident, stored, kv, cfg in self.entries:
            m = next((i for i, (x, y) in enumerate(zip(stored, ids[:-1], strict=False)) if x != y),
                     min(len(stored), len(ids) - 1))
            if ident == identity and m > n:
                best, n = (kv, cfg), m
        if best is None:
            return None, 0
        cache = ConcatCache(best[1])
        for i, (k, v) in enumerate(best[0]):
            cache.update(i, k[..., :n, :].clone(), v[..., :n, :].clone())
        cache.advance(n)
        return cache, n


def test_ch04_prefix_store_counts_the_state_kept_outside_caches():
    with pytest.raises(AssertionError, match="holds .* KiB of tensors"):
        ch04.check_prefix_store(KeepsTensors)


class Recomputes(sol.LRUPrefixStore):
    """Keeps only ids, and computes the state of the common prefix on lookup: always right, and every
    "hit" computed again. It knows the check's models by their manifests."""

    def __init__(self, capacity):
        super().__init__(capacity)
        base = load("tiny-llama")
        tuned = scaled_copy(base, "model.layers.0.mlp.down_proj.weight", 1.5)
        self.models = {m.manifest: m for m in (base, tuned)}

    def lookup(self, identity, ids):
        cache, n = super().lookup(identity, ids)
        if cache is None:
            return None, 0
        model, fresh = self.models[identity.manifest], ConcatCache(self.models[identity.manifest].config)
        forward_cached(torch.tensor([ids[:n]]), model.weights, model.config, fresh)
        fresh.owner = None                   # forget which tensors filled it: the check's model takes it
        return fresh, n


class NeverEvicts(sol.LRUPrefixStore):
    def __init__(self, capacity):
        super().__init__(10**6)                                   # capacity ignored: every state kept


HIDDEN = OrderedDict()


class KeepsThemElsewhere(sol.LRUPrefixStore):
    """Never evicts, and keeps its states outside the object (a module-level dict)."""

    def __init__(self, capacity):
        super().__init__(10**6)
        HIDDEN.clear()
        self.entries = HIDDEN


@pytest.mark.parametrize("store, message", [
    (Recomputes, "ran the model"),
    (NeverEvicts, "more than its capacity"),
    (KeepsThemElsewhere, "more than its capacity"),
])
@pytest.mark.slow  # over 8 s: `make test-slow`
def test_ch04_prefix_store_refuses_a_store_that_does_not_store(store, message):
    with pytest.raises(AssertionError, match=message):
        ch04.check_prefix_store(store)
    HIDDEN.clear()


@pytest.fixture
def book(tmp_path):
    """A results file with the book's key cost (the committed file gains it with the next full run)."""
    path = tmp_path / "results.json"
    results.write_section("ch04", {"key_cost_us": {"T512": results.value(50.0, "µs"),
                                                  "T2048": results.value(190.0, "µs")}},
                          results.provenance(mode="full"), path=path)
    return path


def test_ch04_key_cost_check(book, capsys):
    # T = 2,048 keeps the test short and a key's fixed cost small beside its reads: at 512 ids a loaded
    # machine once measured 512 and 2,048 ids within 1.4x of each other. The reader's default is 4,096
    ratio = ch04.check_key_cost(sol.key_cost_us, T=2048, path=book)
    assert ratio > 0 and "the book's" in capsys.readouterr().out


def test_ch04_key_cost_check_refuses_a_typed_number(book):
    with pytest.raises(AssertionError, match="do not type or look up a number"):
        ch04.check_key_cost(lambda T: 50.0, T=512, path=book)  # the book's number, not a measurement


def test_ch04_key_cost_check_refuses_a_typed_number_after_a_wait(book):
    def waits(T):
        time.sleep(0.01)           # long enough for the number to "fit inside" the call
        return 50.0
    with pytest.raises(AssertionError, match="do not type a number"):
        ch04.check_key_cost(waits, T=512, path=book)


def test_ch04_key_cost_check_refuses_reading_the_books_number(book):
    def looked_up(T):
        sol.key_cost_us(T)
        return results.lookup(results.read(book), f"ch04.key_cost_us.T{T}")["value"]
    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch04.check_key_cost(looked_up, T=512, path=book)


def test_ch04_key_cost_check_refuses_a_number_made_from_T(book):
    def made_up(T):
        time.sleep(0.02)              # long enough for the number to "fit inside" the call
        return T * 1e-3               # grows with T, as a key's cost does, but nothing was timed
    with pytest.raises(AssertionError, match="do not type or compute a number"):
        ch04.check_key_cost(made_up, T=2048, path=book)


def test_ch04_key_cost_check_refuses_the_books_number_read_from_the_file(book):
    def copied(T):
        sol.key_cost_us(T)            # time spent, so the number fits inside the call
        stored = json.loads(book.read_text())["sections"]["ch04"]["values"]["key_cost_us"]["T2048"]["value"]
        return stored * T / 2048      # the book's number, scaled for 4 * T
    with pytest.raises(AssertionError, match="the book's ch04.key_cost_us.T2048 to the last digit"):
        ch04.check_key_cost(copied, T=2048, path=book)
