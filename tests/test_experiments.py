"""lab.experiments' shared run(), what the chapters may import, and the library pieces the chapters use:
lab.kernels.pages.paged_copy.

Oracles: a call log for run(); for paged_copy, the definition of a block table (position t of sequence b
sits in page tables[b, t // page_size] at offset t % page_size), checked slot by slot.
"""

import ast
import types

import pytest
import torch

from lab import experiments
from lab.kernels.pages import paged_copy
from lab.results import REPO_ROOT


def test_run_measures_then_records_and_returns_the_measurements():
    log = []
    chapter = types.SimpleNamespace(measure=lambda quick_mode: log.append(("measure", quick_mode)) or {"x": 1},
                                    record=lambda m: log.append(("record", m)))
    assert experiments.run(chapter, quick_mode=True) == {"x": 1}
    assert log == [("measure", True), ("record", {"x": 1})]


def test_run_by_name_knows_the_chapters():
    assert experiments.chapter("ch02").__name__ == "lab.experiments.ch02_build"
    with pytest.raises(ValueError, match="unknown chapter 'ch99'"):
        experiments.run("ch99")


def _imports(path) -> set:
    """Every module `path` imports, at the top or inside a function, as absolute names (lab.x.y)."""
    package = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts[:-1])         # lab.experiments
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(x for x in (base, node.module) if x)
            out |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return out


def test_nothing_outside_the_exercises_imports_them():
    """The exercises check a reader against the library; the library and the chapters never depend on
    them. (lab.exercises.ch03 and lab.experiments.ch03_savings imported each other: the FLOP counter both
    use lives in lab.step_cost.)"""
    offenders = {str(p.relative_to(REPO_ROOT)): sorted(m for m in _imports(p) if m.startswith("lab.exercises"))
                 for p in (REPO_ROOT / "lab").rglob("*.py") if "exercises" not in p.parts}
    assert {p: m for p, m in offenders.items() if m} == {}


@pytest.mark.parametrize("L, page_size", [(1, 16), (16, 16), (37, 16), (37, 1), (5, 64)])
def test_paged_copy_puts_every_position_where_its_block_table_says(L, page_size):
    B, H, D = 3, 2, 4
    g = torch.Generator().manual_seed(L)
    k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    k_pool, v_pool, tables, lengths = paged_copy(k, v, page_size, g)
    P = -(-L // page_size)
    assert k_pool.shape == v_pool.shape == (B * P, page_size, H, D)
    assert tables.dtype == lengths.dtype == torch.int32 and tables.shape == (B, P) and lengths.tolist() == [L] * B
    assert sorted(tables.flatten().tolist()) == list(range(B * P))          # every page used exactly once
    for b in range(B):
        for t in range(P * page_size):
            page, offset = tables[b, t // page_size], t % page_size
            want_k, want_v = (k[b, :, t], v[b, :, t]) if t < L else (torch.zeros(H, D), torch.zeros(H, D))
            assert torch.equal(k_pool[page, offset], want_k) and torch.equal(v_pool[page, offset], want_v)


# ---- values(m) of chapters 1-8: what a notebook sets beside the book's after each part ----------------------

def grows_by_parts(values, m, parts):
    """values(m) as a notebook calls it, after each part of m in turn (`parts`: tuples of m's keys, in the
    notebook's order): every call adds the entries of its part, and each entry is the one values() records
    for the whole of m. Returns values(m)."""
    full, later = values(m), {k for part in parts for k in part}
    so_far = {k: x for k, x in m.items() if k not in later}
    seen = set(values(so_far))
    for part in parts:
        so_far |= {k: m[k] for k in part}
        v = values(so_far)
        assert set(v) > seen, f"{part} added no entry"
        assert {k: x for k, x in full.items() if k in v} == v, f"after {part}, values differ from the whole's"
        seen = set(v)
    assert seen == set(full)
    return full


def timed(seconds, n=3):
    """A timing summary as lab.bench makes one (every field the chapters read)."""
    return dict(median=seconds, min=0.9 * seconds, max=1.1 * seconds, iqr=0.05 * seconds, n=n, threads=1,
                samples=[seconds * (1 + 0.01 * i) for i in range(n)])


@pytest.fixture(scope="module")
def tiny():
    from lab.models import load

    return load("tiny-llama")


def test_ch01_values_hold_only_the_parts_measured_so_far(tiny):
    from lab.experiments import ch01_recompute as ch01

    m = dict(settings={}, manifests={"tiny-llama": tiny.manifest}, loop=ch01.naive_loop(tiny, 17, 4),
             causal=ch01.causal_mask(tiny, 16), bidirectional=ch01.bidirectional_shift(tiny, 16),
             times={"tiny-llama": {8: timed(0.01), 16: timed(0.02)}},
             prefill_decode={"tiny-llama": ch01.prefill_decode(tiny, [5, 9], 3, progress=False)},
             load=timed(0.5), parity={"tiny-llama": dict(max=0.0, median=0.0, scale=3.0)}, bytes=ch01.bytes_table(),
             dtype_bytes=ch01.dtype_bytes(tiny.config), perplexity=ch01.perplexities(tiny, 1, 32))
    v = grows_by_parts(ch01.values, m, [("loop", "causal", "bidirectional", "times"), ("prefill_decode",),
                                        ("load", "parity", "bytes", "dtype_bytes", "perplexity")])
    assert v["step_ms"]["tiny-llama"]["growth"]["value"] == pytest.approx(2.0)
    assert "min_tpot_over_ttft" in v["prefill_decode"]


def test_ch02_values_hold_only_the_parts_measured_so_far():
    from lab.experiments import ch02_build as ch02

    run = dict(vs_recompute=[1e-5, 2e-5], vs_library=[0.0, 1e-5], tokens=[3, 4], tokens_identical=True, scale=20.0)
    m = dict(settings=ch02.settings(True), manifests={}, runs={("smollm2", d): run for d in ch02.DESIGNS},
             bf16=run, chunked={d: {1: 1e-4, 64: 0.0} for d in ch02.DESIGNS},
             fork={d: dict(parent_vs_recompute=0.0, child_vs_recompute=0.0, parent_untouched=True,
                           shared_bytes=0 if d == "static" else 2**20, parent_bytes=2**20) for d in ch02.DESIGNS},
             crop={d: 0.0 for d in ch02.DESIGNS}, bytes={d: dict(nbytes=8, formula=8, held=8) for d in ch02.DESIGNS},
             decode={d: timed(0.1) for d in ch02.DESIGNS})
    v = grows_by_parts(ch02.values, m, [("runs", "bf16"), ("chunked", "fork", "crop", "bytes"), ("decode",)])
    assert v["all_tokens_identical"]["value"] is True and v["decode_ms"]["static_over_concat"]["value"] == 1.0


def test_ch03_values_hold_only_the_parts_measured_so_far(tiny):
    from lab import step_cost
    from lab.experiments import ch03_savings as ch03

    m = dict(settings=ch03.settings(True), manifests={},
             times={"tiny-llama": step_cost.step_times(tiny, [1, 4], rounds=2, warmup=0, progress=False)},
             shares={"tiny-llama": step_cost.attention_share(tiny, [8], rounds=2, warmup=0, progress=False)},
             predicted={"tiny-llama": step_cost.predicted_shares(tiny, [8])},
             end_to_end={"tiny-llama": ch03.end_to_end(tiny, 5, 3)},
             library={"tiny-llama": dict(lab_concat=0.01, lab_static=0.01, library_dynamic=0.02, library_static=0.02,
                                         ratio_static=0.5, ratio_concat=0.5, tokens_match=True, context=8)},
             memory=[dict(model="tiny-llama", design=d, batch_size=1, peak_extra_bytes=2**20, cache_bytes=2**20)
                     for d in ("concat", "static")])
    v = grows_by_parts(ch03.values, m, [("times",), ("shares", "predicted"), ("end_to_end",), ("library", "memory")])
    assert list(v)[:2] == ["contexts", "step_ms"] and v["memory"]["tokens"]["value"] == m["settings"]["memory_tokens"]


def test_ch04_values_hold_only_the_parts_measured_so_far(tiny):
    from lab.experiments import ch04_identity as ch04
    from lab.identity_cost import key_cost, weights_check_cost

    row = dict(delta_median=0.5, delta_max=5.0, argmax_agree=3, kl_median=0.1, kl_max=0.2, refused_by_cache=0,
               refused=5, backend_correct=5, trials=5)
    m = dict(settings=ch04.settings(True), manifest=tiny.manifest,
             engine=dict(calls=3, hits=2, misses=1, positions=[3], tokens_identical=True, recompute_positions=3),
             key_cost=key_cost(tiny, lengths=(4, 60), reps=3, step_reps=1),
             check_cost=weights_check_cost(tiny, reps=3, rehash_reps=2),
             hazards={name: dict(row) for name in ch04.HAZARDS}, refusal=dict(refused=1, recompute=1))
    v = grows_by_parts(ch04.values, m, [("engine", "key_cost", "check_cost"), ("hazards",), ("refusal",)])
    assert set(v["weights_check"]["share"]) == {"T4", "T60"}


def test_ch05_values_hold_only_the_parts_measured_so_far(tiny):
    from lab import data
    from lab.experiments import ch05_paged as ch05

    lengths = {d: data.synthetic_lengths(d, 40, seed=i) for i, d in enumerate(data.REQUEST_DATASETS)}
    m = dict(settings=ch05.settings(True), manifest=tiny.manifest,
             means={d: (float(i.mean()), float(o.mean())) for d, (i, o) in lengths.items()},
             utilization={d: ch05.utilization(i, o) for d, (i, o) in lengths.items()},
             by_manager={d: ch05.utilization_by_manager(i, o) for d, (i, o) in lengths.items()},
             concurrency={d: ch05.concurrency(i, o, 4096) for d, (i, o) in lengths.items()}, budget_positions=4096,
             speed=ch05.decode_attention_times((64,), (1,), reps=2, repeats=1),
             agreement=ch05.token_agreement(tiny, (1, 16), 37, 3), ragged=ch05.ragged_batch(tiny, new_tokens=2))
    v = grows_by_parts(ch05.values, m, [("means", "utilization", "by_manager"),
                                        ("concurrency", "budget_positions", "speed"), ("agreement", "ragged")])
    assert v["concurrency"]["budget_positions"]["value"] == 4096 and "ragged_batch_identical" in v["agreement"]


def test_ch06_values_hold_only_the_parts_measured_so_far(tiny):
    from lab import workloads
    from lab.experiments import ch06_prefix as ch06

    requests = {name: make(tiny.config.vocab_size, 0.05) for name, make in workloads.WORKLOADS.items()}
    m = dict(settings=ch06.settings(True), manifest=tiny.manifest, threads=1,
             sweep=workloads.hit_rate_sweep(tiny, requests, (0.5, 1.0)), ttft=ch06.ttft(tiny, (16, 32), rounds=2),
             hashing=ch06.hashing_cost(tiny, 256, reps=1), side_channel=ch06.side_channel(tiny, trials=8),
             economics=ch06.economics(tiny, 1e-3, chat=ch06.CHAT | dict(system=200, turns=3)), vllm="not run here")
    v = grows_by_parts(ch06.values, m, [("sweep",), ("ttft",), ("hashing", "side_channel"), ("economics",),
                                        ("vllm",)])
    assert v["vllm"]["cached_identical"]["value"] == "NOT_RUN" and "threads" in v["ttft"]


def test_ch07_values_hold_only_the_parts_measured_so_far(tiny):
    from lab.cache import cache_bytes
    from lab.experiments import ch07_compress as ch07

    s = ch07.settings(True) | dict(tokens=96, passages=2, decode=16, budgets=(32, 48), rerotate_budgets=(32,),
                                   residuals=(0, 16), step_context=32, step_rounds=1)
    ids, prefill, ref = ch07.held_out(tiny, s)
    hf = dict(kl=0.1, positions=32, delta_ppl=0.1, loss=2.0, ref_loss=1.9, top1=0.9, nbytes=1000, batch=2, length=96,
              settings={"nbits": 4})
    bits, positions = ch07.measure_bits(tiny, ids, prefill, ref, s), ch07.measure_positions(tiny, ids, prefill, ref, s)
    m = dict(settings=s, manifest=tiny.manifest, threads=1, prefill=prefill, float_bytes=cache_bytes(tiny.config, 1),
             bf16_bytes=cache_bytes(tiny.config, 1, dtype=torch.bfloat16), transformers={"quanto_4": hf}) | bits
    m |= positions | dict(kvpress=ch07.kvpress_comparison(tiny, ids, s), steps=ch07.measure_steps(tiny, s))
    v = grows_by_parts(ch07.values, m, [("transformers", *bits), tuple(positions), ("kvpress",), ("steps",)])
    assert set(v) >= {"passages", "ref_loss", "quantized", "eviction", "rerotate", "kvpress", "steps"}


def test_ch08_values_hold_only_the_parts_measured_so_far(tiny):
    from lab import step_cost
    from lab.experiments import ch08_serving as ch08

    small = dict(prompt=24, output=20, levels=(1, 3), sequential=2, pools=(5, 40), pool_requests=4, long=96, chunk=32,
                 decoders=2, shared_system=48, shared_requests=3, profile_batch=3)
    m = dict(settings=ch08.settings(True) | small, manifest=tiny.manifest, threads=1, timeline=ch08.timeline_run(tiny),
             batching=ch08.batching(tiny, small), chunked=ch08.chunked_prefill(tiny, small),
             preemption=ch08.preemption(tiny, small), prefix=ch08.prefix_sharing(tiny, small),
             profile=step_cost.profile(tiny, 3, 20, steps=2), step_costs=step_cost.step_costs(tiny, 3, 20), http=None)
    v = grows_by_parts(ch08.values, m, [("timeline",), ("batching",), ("chunked",), ("preemption", "prefix"),
                                        ("profile",), ("step_costs",), ("http",)])
    assert v["http"]["lab"]["value"] == "NOT_RUN"


@pytest.mark.slow  # over 8 s (SmolLM2's weights, three engines): `make test-slow`
def test_the_steps_experiment_in_quick_mode(tmp_path, monkeypatch):
    """lab.experiments.steps measures every engine shape beside the plain one and writes section `steps`:
    the hybrid engine reads fewer bytes than the plain one, the radix engines as many (the same positions)."""
    from lab import results
    from lab.experiments import steps

    monkeypatch.setenv("LAB_RESULTS", str(tmp_path / "results.json"))
    m = steps.measure(quick_mode=True)
    steps.record(m)
    v = results.read(tmp_path / "results.json")["sections"]["steps"]["values"]
    h = v["hybrid_short"]
    assert h["hybrid"]["read_mib"]["value"] < h["plain"]["read_mib"]["value"]
    r = v["radix"]
    assert r["pages_16"]["read_mib"]["value"] == r["plain"]["read_mib"]["value"] == r["pages_1"]["read_mib"]["value"]
    assert r["plain"]["over_plain"]["value"] == 1.0 and h["hybrid"]["over_plain"]["n"] == 3
    assert v["hybrid_long"]["positions"]["value"] == 2048 and r["positions"]["value"] == 128
