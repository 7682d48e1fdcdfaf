"""Reference solutions for chapter 4: a least-recently-used store of prefixes; the cost of a key."""

from collections import OrderedDict

from ..bench import time_call
from ..engine import key_for, prefix_key


class LRUPrefixStore:
    def __init__(self, capacity):
        self.capacity, self.entries = capacity, OrderedDict()  # key -> (identity, ids, cache)

    def lookup(self, identity, ids):
        best, best_n = None, 0
        for key, (ident, stored, _) in self.entries.items():
            if ident != identity:                     # another model, dtype or tenant: never shared
                continue
            n, limit = 0, min(len(stored), len(ids) - 1)
            while n < limit and stored[n] == ids[n]:
                n += 1
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)                # used: now the most recent
        cache = self.entries[best][2].fork()          # the stored state stays intact
        cache.crop(best_n)
        return cache, best_n

    def insert(self, identity, ids, cache):
        key = key_for(identity, ids)
        self.entries[key] = (identity, list(ids), cache)
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)          # evict the least recently used


def key_cost_us(T):
    """Median microseconds of prefix_key over T ids (the identity's fields made up: only their size matters)."""
    ids = list(range(T))
    t = time_call(lambda: prefix_key("m" * 64, ids, tokenizer="t" * 64), warmup=5, reps=200)
    return t["median"] * 1e6
