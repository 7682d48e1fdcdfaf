"""Chapter 4's adapter swap at a realistic size: a LoRA adapter of rank 8 on the query and value projections
(lab.updates.lora_factors, lora_merged), the refusals it must meet, and the damage ch04 measures when the
adapted model reads a cache the base model filled.

Oracles: the weights compared element by element and their singular values (what the adapter changes, and
its rank); recomputation with the adapted weights (what the backend must serve); and, for the measured
damage, transformers' own Llama on the base weights with the adapter applied unmerged (forward hooks that
add x·Aᵀ·Bᵀ to each adapted projection) and transformers' own DynamicCache: neither lab's forward, nor its
caches, nor the merged weights.
"""

import re
import statistics

import pytest
import torch

from lab import data, updates
from lab.cache import CacheMismatchError
from lab.engine import CachedBackend
from lab.experiments import ch04_identity as ch04
from lab.metrics import kl_divergence
from lab.models import forward, forward_cached, load
from lab.models.hf import to_transformers

PREFIX, CONTINUATION, TRIALS = 24, 8, 2


@pytest.fixture(scope="module")
def adapter(smollm2):
    factors = updates.lora_factors(smollm2)
    return factors, updates.lora_merged(smollm2, factors)


def test_the_adapter_changes_exactly_q_and_v_of_every_layer_by_rank_8(smollm2, adapter):
    factors, adapted = adapter
    q_or_v = re.compile(r"model\.layers\.\d+\.self_attn\.[qv]_proj\.weight")
    changed = {k for k, w in smollm2.weights.items() if not torch.equal(adapted.weights[k], w)}
    assert changed == {k for k in smollm2.weights if q_or_v.fullmatch(k)} == set(factors)
    assert len(changed) == 2 * smollm2.config.n_layers == 60
    for k in sorted(changed):
        w = smollm2.weights[k]
        delta = adapted.weights[k] - w                                    # the merged update, as served
        s = torch.linalg.svdvals(delta)                                   # descending
        # Rank 8: eight singular values of the update's own size, then rounding. W + B·A is rounded to
        # float32 (about 6e-8 of |W| an element), and so is the decomposition, which leaves singular values
        # near 1e-6 of the largest; the eighth of a product of two Gaussian factors is a sizeable fraction
        # of the first (0.3 or more). The matrix rank at a tolerance of 1e-4 of the largest is then exact.
        assert s[7] > 1e-2 * s[0] and s[8] < 1e-4 * s[0], (k, s[6:10] / s[0])
        assert (s > 1e-4 * s[0]).sum().item() == updates.LORA_RANK == 8
        # Its size: |B·A| = LORA_NORM x |W|, up to the same float32 rounding (1e-4 relative is ample).
        assert (delta.norm() / w.norm()).item() == pytest.approx(updates.LORA_NORM, rel=1e-4)
    b, a = factors["model.layers.0.self_attn.v_proj.weight"]
    assert b.shape == (smollm2.config.n_kv_heads * smollm2.config.head_dim, 8)
    assert a.shape == (8, smollm2.config.d_model)


def test_the_adapter_is_seeded_and_refuses_another_architecture():
    tiny = load("tiny-llama")
    one, again, other = (updates.lora_factors(tiny, seed=s) for s in (0, 0, 1))
    assert all(torch.equal(one[k][i], again[k][i]) for k in one for i in (0, 1))
    assert not torch.equal(one["model.layers.0.self_attn.q_proj.weight"][1],
                           other["model.layers.0.self_attn.q_proj.weight"][1])
    with pytest.raises(ValueError, match="Llama"):
        updates.lora_factors(load("tiny-gpt2"))


def test_the_manifest_changes_and_the_cache_and_the_backend_refuse(smollm2, adapter):
    factors, adapted = adapter
    before = smollm2.manifest
    assert adapted.manifest != before and len(adapted.manifest) == 64
    assert updates.lora_merged(smollm2, factors).manifest == adapted.manifest   # the same adapter: the same
    assert smollm2.manifest == before                                          # the base model is untouched
    prefix, nxt = data.passages(smollm2.tokenizer, PREFIX + 1, count=1, seed=7)[0][:PREFIX], 5
    cache = ch04.prefill(smollm2, prefix)
    with pytest.raises(CacheMismatchError), torch.inference_mode():
        forward_cached(torch.tensor([[nxt]]), adapted.weights, adapted.config, cache)
    assert cache.length == PREFIX                                              # the refused call changed nothing
    backend = CachedBackend(smollm2, ch04.static_for(smollm2, 64))
    backend.next_logits(prefix)
    backend.model, backend.cache_factory = adapted, ch04.static_for(adapted, 64)   # the adapter swap
    served = backend.next_logits(prefix + [nxt])
    with torch.inference_mode():
        right = forward(torch.tensor([prefix + [nxt]]), adapted.weights, adapted.config)[0, -1]
    assert (backend.hits, backend.misses) == (0, 2)
    # a recomputation: equal up to float32 summation order (1e-4 of the largest logit, as in ch04's trials)
    assert (served - right).abs().max() <= 1e-4 * right.abs().max()


def hooked(hf, factors):
    """The adapter applied as LoRA runs unmerged: each adapted projection's output gains x·Aᵀ·Bᵀ."""
    def add_update(a, b):
        return lambda module, args, out: out + args[0] @ a.T @ b.T          # [B, T, in] -> [B, T, out]
    return [hf.get_submodule(name.removesuffix(".weight")).register_forward_hook(add_update(a, b))
            for name, (b, a) in factors.items()]


@torch.inference_mode()
def transformers_oracle(smollm2, factors, passages):
    """Per passage: the adapted model's scores read through a DynamicCache the base model filled (`wrong`),
    the adapted model from scratch (`right`), the base model (`base`); all `[C, V]`, by transformers."""
    from transformers import DynamicCache

    hf, out = to_transformers(smollm2), []
    for p in passages:
        ids = torch.tensor([p])
        base = hf(ids).logits[0, PREFIX:]                                 # the base model, no cache
        past = DynamicCache()
        hf(ids[:, :PREFIX], past_key_values=past)                         # the base model fills the cache
        hooks = hooked(hf, factors)
        wrong = hf(ids[:, PREFIX:], past_key_values=past).logits[0]
        right = hf(ids).logits[0, PREFIX:]
        for h in hooks:
            h.remove()
        out.append(dict(wrong=wrong.float(), right=right.float(), base=base.float()))
    return out


@pytest.mark.slow   # about 10 s on two busy cores: the adapter, two backends and transformers' model
def test_the_measured_damage_is_what_an_independent_oracle_says(smollm2, adapter):
    factors, _ = adapter
    m = ch04.lora_hazard(smollm2, TRIALS, PREFIX, CONTINUATION, progress=False)
    passages = data.passages(smollm2.tokenizer, PREFIX + CONTINUATION, count=TRIALS, seed=7)  # lora_hazard's
    oracle = transformers_oracle(smollm2, factors, passages)
    # lab and transformers agree within 1e-4 of the largest |logit| (tests/test_models.py): about 3e-3 here
    eps = 1e-4 * max(o["right"].abs().max().item() for o in oracle)

    assert m["cont_delta_max"] == pytest.approx(max((o["wrong"] - o["right"]).abs().max().item()
                                                    for o in oracle), abs=2 * eps)
    assert m["cont_delta_max"] > 100 * eps                                # the damage is far above the parity
    # Top-1 agreement is a count: equal, provided no top token of the oracle is within 2 eps of the runner-up
    for o in oracle:
        for scores in (o["wrong"], o["right"], o["base"]):
            top2 = scores.topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min() > 2 * eps
    agree = sum((o["wrong"].argmax(-1) == o["right"].argmax(-1)).sum().item() for o in oracle)
    assert m["cont_argmax_agree"] == agree and m["positions"] == TRIALS * CONTINUATION
    assert m["argmax_agree"] == sum(int(o["wrong"][0].argmax() == o["right"][0].argmax()) for o in oracle)
    assert m["base_argmax_agree"] == sum((o["base"].argmax(-1) == o["right"].argmax(-1)).sum().item()
                                         for o in oracle)
    # KL: within 1e-3 nats. Both sides' logits are off by at most eps; a shift of every logit by up to eps
    # moves KL by at most a few eps, and in practice by far less (4e-6 nats on these passages). 1e-3 is a
    # hundredth of the KL measured here, so scores of another position or passage would still fail.
    kl = torch.cat([kl_divergence(o["right"], o["wrong"]) for o in oracle])
    base_kl = torch.cat([kl_divergence(o["right"], o["base"]) for o in oracle])
    assert m["cont_kl_mean"] == pytest.approx(kl.mean().item(), abs=1e-3)
    assert m["base_kl_mean"] == pytest.approx(base_kl.mean().item(), abs=1e-3)
    first = kl.view(TRIALS, CONTINUATION)[:, 0].tolist()                  # the table's row: the first position
    assert m["kl_median"] == pytest.approx(statistics.median(first), abs=1e-3)
    assert m["cont_kl_mean"] > 10 * 1e-3 and m["cont_kl_mean"] < m["base_kl_mean"]
    assert (m["refused_by_cache"], m["refused"], m["backend_correct"]) == (TRIALS, TRIALS, TRIALS)
    assert (m["matrices"], m["rank"], m["manifest_changed"]) == (60, 8, True)


def test_lora_values_and_figure_are_recorded(tmp_path, monkeypatch):
    """The LoRA part alone is a part of its own: values() records it under ch04.lora, record() draws its
    figure and adds its row to the hazards figure."""
    monkeypatch.setenv("LAB_RESULTS", str(tmp_path / "results.json"))
    tiny = load("tiny-llama")
    lora = ch04.lora_hazard(tiny, trials=2, prefix_len=8, continuation=6, progress=False)
    assert set(ch04.values({"lora": lora})) == {"lora"}
    row = dict(delta_median=0.5, delta_max=5.0, argmax_agree=3, kl_median=0.1, kl_max=0.2, refused_by_cache=0,
               refused=5, backend_correct=5, trials=5)
    hazards = {name: dict(row) for name in ch04.HAZARDS}
    hazards["weights_in_place"] |= dict(lr=5e-6, relative_update=1e-4)
    v = ch04.record(dict(settings=ch04.settings(True), manifest=tiny.manifest, hazards=hazards, lora=lora))
    assert (tmp_path / "figures" / "ch04_lora.png").exists() and (tmp_path / "figures" / "ch04_hazards.png").exists()
    assert v["lora"]["positions"]["value"] == 12 and v["lora"]["rank"]["value"] == 8
    assert v["lora"]["targets"]["value"] == "q_proj, v_proj" and v["lora"]["manifest_changed"]["value"] is True
    assert v["lora"]["cont_argmax_agree"]["value"] <= 12 and v["lora"]["refused"]["value"] == 2
