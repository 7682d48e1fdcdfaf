"""Chapter 2 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut."""

import functools

import pytest
import torch

from lab import results
from lab.exercises import ch02
from lab.exercises import ch02_solutions as sol2


def test_ch02_mask_offset_check_passes_the_reference():
    assert ch02.check_mask_offset(sol2.offset_causal_mask)


def test_ch02_mask_offset_check_fails_wrong_masks():
    with pytest.raises(AssertionError, match="one-shot"):  # the mask without the offset: aligned top-left
        ch02.check_mask_offset(lambda start, T: torch.ones(T, start + T, dtype=torch.bool).tril())
    with pytest.raises(AssertionError, match="expected a bool"):  # only the new keys
        ch02.check_mask_offset(lambda start, T: torch.ones(T, T, dtype=torch.bool).tril())


def test_ch02_mask_offset_check_rejects_labs_own_mask():
    from lab.cache import base
    from lab.cache.base import offset_causal_mask

    with pytest.raises(AssertionError, match="lab's own offset_causal_mask"):  # imported as it is
        ch02.check_mask_offset(offset_causal_mask)
    with pytest.raises(AssertionError, match="lab's own offset_causal_mask"):  # wrapped in a partial
        ch02.check_mask_offset(functools.partial(offset_causal_mask, device="cpu"))

    def held_in_a_closure(start, T, mask=offset_causal_mask):
        return mask(start, T)

    with pytest.raises(AssertionError, match="lab's own offset_causal_mask"):
        ch02.check_mask_offset(held_in_a_closure)
    # looked up at call time through the module: lab's function is a stub that raises while the check runs
    with pytest.raises(AssertionError, match="called lab's offset_causal_mask"):
        ch02.check_mask_offset(lambda start, T: base.offset_causal_mask(start, T))
    assert base.offset_causal_mask is offset_causal_mask  # restored afterwards


def test_ch02_sequences_check():
    assert ch02.check_sequences_that_fit(sol2.sequences_that_fit)
    with pytest.raises(AssertionError, match="caches say"):  # forgets the weights
        ch02.check_sequences_that_fit(lambda m, w, c, t, b: sol2.sequences_that_fit(m, 0, c, t, b))


def test_ch02_sequences_check_forbids_building_a_cache():
    from lab.cache import StaticCache, cache_bytes

    def with_a_cache(memory, weights, config, tokens, dtype_bytes):  # the shortcut: let a cache count
        dtype = {4: torch.float32, 2: torch.float16}[dtype_bytes]
        return max(0, (memory - weights) // StaticCache(config, tokens, dtype=dtype, device="meta").nbytes())

    def with_cache_bytes(memory, weights, config, tokens, dtype_bytes):
        dtype = {4: torch.float32, 2: torch.float16}[dtype_bytes]
        return max(0, (memory - weights) // cache_bytes(config, tokens, dtype=dtype))

    for shortcut in (with_a_cache, with_cache_bytes):
        with pytest.raises(AssertionError, match="called lab's"):
            ch02.check_sequences_that_fit(shortcut)
    from lab import cache
    assert cache.StaticCache is StaticCache and cache.cache_bytes is cache_bytes  # restored afterwards


def test_ch02_crop_check():
    assert ch02.check_crop(sol2.crop)

    def slicing_crop(cache, n):  # keeps the storage alive: the bytes check must catch it
        cache.keys = [k[:, :, :n] for k in cache.keys]
        cache.values = [v[:, :, :n] for v in cache.values]
        cache.length = n

    with pytest.raises(AssertionError, match="bytes"):
        ch02.check_crop(slicing_crop)


def test_ch02_crop_check_forbids_the_caches_own_crop():
    with pytest.raises(AssertionError, match=r"called cache\.crop\(\)"):
        ch02.check_crop(lambda cache, n: cache.crop(n))
    with pytest.raises(AssertionError, match="own truncation"):
        ch02.check_crop(lambda cache, n: (cache._truncate(n), setattr(cache, "length", n)))


def test_ch02_open_ended_decode_step(tmp_path, capsys):
    """The reference measurement runs on a tiny model, and the comparison reads the book's key."""
    from lab.cache import ConcatCache, StaticCache
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
