"""The memory probe (a child process per run) and the lab-vs-transformers decode comparison, on tiny models."""

import pytest

from lab.cache import cache_bytes
from lab.experiments.library import compare, lab_decode_time, library_decode_time
from lab.experiments.memory import probe
from lab.models import load


@pytest.mark.parametrize("design", ["concat", "static"])
def test_probe_reports_the_cache_it_built(design):
    r = probe("tiny-llama", design, batch_size=2, tokens=64)
    expected = cache_bytes(load("tiny-llama").config, 64, batch_size=2)
    assert r["design"] == design and r["length"] == 64
    assert r["cache_bytes"] == expected
    assert r["final_nbytes"] == expected  # concat too: it holds exactly the 64 positions at the end
    assert isinstance(r["peak_extra_bytes"], int) and r["peak_extra_bytes"] >= 0
    assert r["peak_rss"] >= r["baseline_rss"] > 0


def test_probe_rejects_an_unknown_design():
    with pytest.raises(RuntimeError, match="design"):
        probe("tiny-llama", "paged", batch_size=1, tokens=32)


@pytest.mark.parametrize("design", ["concat", "static"])
def test_lab_decode_time_is_positive(design):
    r = lab_decode_time("tiny-llama", design, context=32, new_tokens=4, reps=1)
    assert r["median"] > 0 and r["min"] <= r["median"] <= r["max"] and r["threads"] >= 1


@pytest.mark.parametrize("implementation", ["dynamic", "static"])
def test_library_decode_time_is_positive(implementation):
    # 15 decode steps and the median of 3 reps: the difference (full - prefill alone) is a few tens of ms of
    # decode work, well above the jitter of two separate generate() calls on a busy machine
    r = library_decode_time("tiny-llama", implementation, context=32, new_tokens=16, reps=3)
    assert r["full_median"] > 0 and r["prefill_median"] > 0
    assert r["median"] > 0  # (15 decode steps) - (prefill alone): decode work is never free


def test_lab_tokens_match_transformers_generate():
    r = compare(("tiny-llama",), context=32, new_tokens=4, reps=1, progress=False)["tiny-llama"]
    assert r["tokens_match"] is True
    assert all(r[k] > 0 for k in ("lab_concat", "lab_static"))
