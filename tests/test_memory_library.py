"""The memory probe (a child process per run) and the lab-vs-transformers decode comparison, on tiny models.

The comparison's timings run on a fake clock (FakeClock in tests/conftest.py) that only the timed work
moves: every lab forward 1 s, every `generate` 7 s of prefill and 3 s per token after the first. The
models still run for real (the tokens compared are real), but each duration the code reports is known
exactly, so the tests check what is timed and how it is combined, and a busy machine cannot fail them.
"""

import platform

import pytest

from lab import bench
from lab.cache import cache_bytes
from lab.memory import probe, sweep
from lab.models import hf as hf_module
from lab.models import load
from lab.peers import hf_generate
from lab.peers.hf_generate import compare, lab_decode_time, library_decode_time

LAB_STEP, LIBRARY_PREFILL, LIBRARY_STEP = 1, 7, 3    # fake seconds, see the module docstring


@pytest.fixture
def work_clock(monkeypatch, fake_clock):
    """lab.peers.hf_generate on a fake clock that its own forwards and generate calls advance."""
    for module in (bench, hf_generate):                  # wherever the timings read the clock
        if hasattr(module, "time"):
            monkeypatch.setattr(module, "time", fake_clock)
    real_forward, real_to_transformers = hf_generate.forward_cached, hf_module.to_transformers

    def forward_cached(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        fake_clock.advance(LAB_STEP)
        return out

    def to_transformers(model):
        hf = real_to_transformers(model)
        real_generate = hf.generate

        def generate(ids, **kwargs):                 # charged by the tokens it really generated
            out = real_generate(ids, **kwargs)
            fake_clock.advance(LIBRARY_PREFILL + LIBRARY_STEP * (out.shape[1] - ids.shape[1] - 1))
            return out

        hf.generate = generate
        return hf

    monkeypatch.setattr(hf_generate, "forward_cached", forward_cached)
    monkeypatch.setattr(hf_module, "to_transformers", to_transformers)
    return fake_clock


@pytest.mark.parametrize("design", ["concat", "static"])
def test_probe_reports_the_cache_it_built(design):
    r = probe("tiny-llama", design, batch_size=2, tokens=64)
    expected = cache_bytes(load("tiny-llama").config, 64, batch_size=2)
    assert (r["design"], r["batch_size"], r["tokens"], r["length"]) == (design, 2, 64, 64)
    assert r["cache_bytes"] == expected
    assert r["final_nbytes"] == expected  # concat too: it holds exactly the 64 positions at the end
    # The child returned its free heap to the OS before its baseline (malloc_trim), wherever glibc is the C library.
    assert r["trimmed"] is (platform.libc_ver()[0] == "glibc")


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_sweep_gives_one_probe_per_case_and_chapter_3_draws_them(tmp_path):
    """memory.sweep: a fresh probe per (model, batch, design); ch03.plot_memory: one bar per probe, at its
    peak extra RSS in MiB, and the formula's line per (model, batch)."""
    from lab.experiments import ch03_savings as ch03

    rows = sweep(("tiny-llama",), ("concat", "static"), (1, 2), tokens=40, progress=False)
    assert [(r["batch_size"], r["design"]) for r in rows] == [(1, "concat"), (1, "static"), (2, "concat"),
                                                               (2, "static")]
    fig = ch03.plot_memory(rows, tmp_path / "memory.png")
    heights = sorted(p.get_height() for p in fig.axes[0].patches)
    assert heights == pytest.approx(sorted(r["peak_extra_bytes"] / 2**20 for r in rows), abs=1e-9)
    assert (tmp_path / "memory.png").exists()


def test_probe_rejects_an_unknown_design():
    with pytest.raises(RuntimeError, match="design"):
        probe("tiny-llama", "paged", batch_size=1, tokens=32)


@pytest.mark.parametrize("design", ["concat", "static"])
def test_lab_decode_time_times_the_decode_steps_only(work_clock, design):
    r = lab_decode_time("tiny-llama", design, context=32, new_tokens=4, reps=2)
    # Per rep, 1 prefill + 4 decode forwards; only the 4 are timed: 4 s / 4 tokens. A timed prefill
    # would give 5/4.
    assert r["median"] == r["min"] == r["max"] == LAB_STEP and r["reps"] == 2
    assert work_clock.now == 3 * 5 * LAB_STEP         # the warm-up rep ran too, and is not among the reps


@pytest.mark.parametrize("implementation", ["dynamic", "static"])
def test_library_decode_time_is_full_minus_prefill_per_decode_step(work_clock, implementation):
    r = library_decode_time("tiny-llama", implementation, context=32, new_tokens=4, reps=2)
    # One generate of 1 token (7 s) and one of 4 tokens (7 + 3 * 3 = 16 s) per rep: (16 - 7) / 3 per decode
    # step. generate must produce exactly the tokens asked for (no early stop), or these move.
    assert (r["prefill_median"], r["full_median"]) == (LIBRARY_PREFILL, LIBRARY_PREFILL + 3 * LIBRARY_STEP)
    assert r["median"] == r["min"] == r["max"] == LIBRARY_STEP and r["reps"] == 2


def test_lab_tokens_match_transformers_generate_and_ratios_pair_the_right_timings(work_clock):
    r = compare(("tiny-llama",), context=32, new_tokens=4, reps=1, progress=False)["tiny-llama"]
    assert r["tokens_match"] is True and r["first_mismatch"] is None
    assert r["lab_concat"] == r["lab_static"] == LAB_STEP
    assert r["library_dynamic"] == r["library_static"] == LIBRARY_STEP
    assert r["ratio_static"] == r["ratio_concat"] == LAB_STEP / LIBRARY_STEP
