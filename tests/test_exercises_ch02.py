"""Chapter 2 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

The cases are drawn fresh at every run; a test passes `seed=` where it must know them.
"""

import functools
import importlib
import importlib.util

import pytest
import torch
from attacks import copy_of, loaded_again
from torch.nn.attention.bias import causal_lower_right

from lab import results
from lab.cache import ConcatCache, KVCache, StaticCache, cache_bytes
from lab.cache.base import offset_causal_mask
from lab.exercises import ch02
from lab.exercises import ch02_solutions as sol2

base = importlib.import_module("lab.cache.base")




# ---- exercise 1: the mask offset ----------------------------------------------------------------------------

def test_ch02_mask_offset_check_passes_the_reference():
    assert ch02.check_mask_offset(sol2.offset_causal_mask)
    assert ch02.check_mask_offset(sol2.offset_causal_mask, seed=1)


def test_ch02_mask_offset_check_fails_wrong_masks():
    with pytest.raises(AssertionError, match="one-shot"):  # the mask without the offset: aligned top-left
        ch02.check_mask_offset(lambda start, T: torch.ones(T, start + T, dtype=torch.bool).tril())
    with pytest.raises(AssertionError, match="expected a bool"):  # only the new keys
        ch02.check_mask_offset(lambda start, T: torch.ones(T, T, dtype=torch.bool).tril())


def held_in_a_closure(start, T, mask=offset_causal_mask):
    return mask(start, T)


mask_again = loaded_again(base).offset_causal_mask


@pytest.mark.parametrize("shortcut", [
    offset_causal_mask,                                            # imported as it is
    functools.partial(offset_causal_mask, device="cpu"),           # wrapped in a partial
    held_in_a_closure,
    lambda start, T: base.offset_causal_mask(start, T),            # looked up at call time through the module
    copy_of(offset_causal_mask),                                   # a copy made before the check
    lambda start, T: mask_again(start, T),                         # its module loaded again
    lambda start, T: causal_lower_right(T, start + T)._materialize(),   # PyTorch's own offset mask
], ids=["as-is", "partial", "closure", "module", "copy", "module-loaded-again", "causal_lower_right"])
def test_ch02_mask_offset_check_rejects_labs_own_mask(shortcut):
    with pytest.raises(AssertionError, match="called lab's offset_causal_mask"):
        ch02.check_mask_offset(shortcut)
    assert base.offset_causal_mask is offset_causal_mask and offset_causal_mask(1, 2).shape == (2, 3)  # restored


def test_ch02_mask_offset_check_refuses_masks_tabulated_beforehand():
    table = {(s, T): offset_causal_mask(s, T) for s in range(41) for T in range(1, 41)}   # every start the prefill uses
    with pytest.raises(AssertionError, match="shifted right"):
        ch02.check_mask_offset(lambda start, T: table.get((start, T), torch.ones(T, start + T, dtype=torch.bool)))


# ---- exercise 2: how many sequences fit ---------------------------------------------------------------------

def test_ch02_sequences_check():
    assert ch02.check_sequences_that_fit(sol2.sequences_that_fit)
    with pytest.raises(AssertionError, match="caches say"):  # forgets the weights
        ch02.check_sequences_that_fit(lambda m, w, c, t, b: sol2.sequences_that_fit(m, 0, c, t, b), seed=0)


DTYPES = {1: torch.int8, 2: torch.float16, 4: torch.float32}


def with_a_cache(memory, weights, config, tokens, dtype_bytes):  # the shortcut: let a cache count
    return max(0, (memory - weights) // StaticCache(config, tokens, dtype=DTYPES[dtype_bytes], device="meta").nbytes())


def with_cache_bytes(memory, weights, config, tokens, dtype_bytes):
    return max(0, (memory - weights) // cache_bytes(config, tokens, dtype=DTYPES[dtype_bytes]))


class MyCache(StaticCache):   # a subclass of the reader's own still runs StaticCache's constructor
    pass


def with_a_subclass(memory, weights, config, tokens, dtype_bytes):
    return max(0, (memory - weights) // MyCache(config, tokens, dtype=DTYPES[dtype_bytes], device="meta").nbytes())


def with_the_config(memory, weights, config, tokens, dtype_bytes):  # the config's own bytes per position
    return max(0, (memory - weights) // (tokens * config.kv_bytes_per_position(DTYPES[dtype_bytes])))


@pytest.mark.parametrize("shortcut", [with_a_cache, with_cache_bytes, with_a_subclass, with_the_config,
                                      lambda m, w, c, t, b: copy_of(with_cache_bytes)(m, w, c, t, b)])
def test_ch02_sequences_check_forbids_building_a_cache(shortcut):
    with pytest.raises(AssertionError, match="called lab's caches or sizing"):
        ch02.check_sequences_that_fit(shortcut)
    from lab import cache
    assert cache.StaticCache is StaticCache and cache.cache_bytes is cache_bytes  # restored afterwards
    assert StaticCache(ch02.load("tiny-llama").config, 4, device="meta").nbytes() > 0


def test_ch02_sequences_check_refuses_the_old_fixed_cases_hard_coded():
    known = {}   # the old check's nine cases, answered beforehand with a real cache
    for name, dtype in (("tiny-llama", torch.float32), ("tiny-gpt2", torch.bfloat16), ("smollm2", torch.float16)):
        model = ch02.load(name)
        weights = sum(t.nbytes for t in model.weights.values())
        for tokens, memory in ((128, 2**24), (1000, 2**30), (4096, 80 * 2**30)):
            per_seq = StaticCache(model.config, tokens, dtype=dtype, device="meta").nbytes()
            known[(memory, weights, tokens, dtype.itemsize)] = max(0, (memory - weights) // per_seq)
    with pytest.raises(AssertionError, match="caches say"):
        ch02.check_sequences_that_fit(lambda m, w, c, t, b: known.get((m, w, t, b), 0))


# ---- exercise 3: crop --------------------------------------------------------------------------------------

def test_ch02_crop_check():
    assert ch02.check_crop(sol2.crop)

    def slicing_crop(cache, n):  # keeps the storage alive: the bytes check must catch it
        cache.keys = [k[:, :, :n] for k in cache.keys]
        cache.values = [v[:, :, :n] for v in cache.values]
        cache.length = n

    with pytest.raises(AssertionError, match="bytes"):
        ch02.check_crop(slicing_crop)


@pytest.mark.parametrize("shortcut", [
    lambda cache, n: cache.crop(n),
    lambda cache, n: ConcatCache.crop(cache, n),                                 # unbound
    lambda cache, n: KVCache.crop(cache, n),
    lambda cache, n: super(type(cache), cache).crop(n) if type(cache) is not KVCache else None,
    lambda cache, n: (cache._truncate(n), setattr(cache, "length", n)),
    lambda cache, n: (ConcatCache._truncate(cache, n), setattr(cache, "length", n)),   # unbound, past any override
    lambda cache, n: (copy_of(ConcatCache._truncate)(cache, n), setattr(cache, "length", n)),
    lambda cache, n: cache.reset() if n == 0 else cache.crop(n),
], ids=["crop", "unbound-crop", "base-crop", "super-crop", "truncate", "unbound-truncate", "copied-truncate",
        "reset"])
def test_ch02_crop_check_forbids_the_caches_own_crop(shortcut):
    with pytest.raises(AssertionError, match="cache's own crop"):
        ch02.check_crop(shortcut)
    cache = ConcatCache(ch02.load("tiny-llama").config)
    cache.crop(0)                                                                # restored afterwards


def test_ch02_open_ended_decode_step(tmp_path, capsys):
    """The reference measurement runs on a tiny model, and the comparison reads the book's key."""
    from lab.models import load

    model = load("tiny-llama")
    for cache in (ConcatCache(model.config), StaticCache(model.config, 40)):
        ms = sol2.decode_step_ms(model, cache, context=32, reps=3)
        assert 0 < ms < 10_000 and cache.length == 33
    path = tmp_path / "r.json"
    results.write_section("ch02", {"decode_ms": {"static": results.value(40.0, "ms")}},
                          results.provenance(mode="full"), path=path)
    assert ch02.compare_decode_step("static", 20.0, path=path) == pytest.approx(0.5)
    assert "the book's: 40 ms" in capsys.readouterr().out
    with pytest.raises(ValueError, match="design"):
        ch02.compare_decode_step("paged", 1.0, path=path)


def test_ch02_mask_check_refuses_patching_its_comparisons():
    real = torch.allclose, torch.equal

    def patches(start, T):
        torch.allclose = torch.equal = lambda *a, **k: True
        return torch.ones(T, start + T, dtype=torch.bool)           # every key visible: wrong

    with pytest.raises(AssertionError, match="changed torch.allclose"):
        ch02.check_mask_offset(patches)
    assert (torch.allclose, torch.equal) == real                     # put back
