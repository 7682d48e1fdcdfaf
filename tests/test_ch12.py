"""Chapter 12's measurements, on small settings and the tiny model (the notebook records the whole section in
quick mode on SmolLM2).

Oracles: page counts worked out by hand for small cases, n requests of their own against n answers forked (the
same seeds give the same tokens), and the recorded values against the measurements they came from.
"""

import pytest

from lab.branches import sampling_pages
from lab.experiments import ch12_branches as ch12
from lab.models import load

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def test_sampling_pages_counts_what_a_hand_count_gives():
    """A prompt of 32 positions (2 full pages of 16) and 2 answers of 17 tokens: 2 + 16 x 4 page-steps forked
    (each answer's third page from step 1), 4 + 16 x 6 apart; a prompt of 19 with 4 answers copies its shared
    partly filled page 3 times (the last answer to write finds it its own)."""
    r = sampling_pages(32, [17, 17], 16)
    assert (r["shared"], r["independent"], r["peak_shared"], r["peak_independent"]) == (66, 100, 4, 6)
    assert r["saving"] == pytest.approx(1 - 66 / 100) and r["copies"] == 0
    assert sampling_pages(19, [58, 40, 71, 12], 16)["copies"] == 3
    assert sampling_pages(16, [1, 1], 16)["shared"] == 1            # one token each: the prefill's page only
    with pytest.raises(ValueError):
        sampling_pages(0, [3], 16)


def test_more_answers_of_one_length_save_more_and_the_sweeps_save_some(tiny):
    """Answers of one length: the saving grows with n (the prompt's share held once of n); the sweeps over
    drawn lengths save something at every n, and so does beam search."""
    savings = [sampling_pages(40, [20] * n, 16)["saving"] for n in (2, 4, 8)]
    assert 0 < savings[0] < savings[1] < savings[2] < 1
    s = dict(ch12.settings(True), sampling_requests=20, beam_requests=1, beam_cap=6)
    sampling = ch12.sampling_memory(s)
    assert all(0 < sampling[d][n]["saving"] < 1 for d in sampling for n in s["ns"])
    beams = ch12.beam_memory(tiny, s)
    assert all(0 < r["saving"] < 1 for x in beams.values() for r in x.values())


def test_forked_answers_equal_answers_apart_and_the_values_record_them(tiny):
    s = dict(ch12.settings(True), engine_prompts=2, engine_prompt=24, engine_new=4, engine_n=3, engine_rounds=2)
    e = ch12.engine_end_to_end(tiny, s)
    assert e["same_answers"] and e["forked"]["computed_tokens"] < e["apart"]["computed_tokens"]
    m = dict(settings=s, engine=e, http="not run here")
    v = ch12.values(m)
    assert v["engine"]["forked"]["tokens_per_s"]["value"] == pytest.approx(e["forked"]["tokens_per_s"])
    assert v["engine"]["speedup"]["value"] == pytest.approx(e["forked"]["tokens_per_s"] / e["apart"]["tokens_per_s"])
    assert v["http"]["same_greedy"]["reason"] == "not run here"


def test_attention_values_hold_the_ratio_of_the_cases_they_came_from():
    rows = [dict(dtype="float32", n=n, shared=sh, cascade_ms=1.0 * sh / 1024, paged_ms=n * sh / 1024,
                 cascade_iqr_ms=0.0, paged_iqr_ms=0.0, speedup=n, cascade_MB=1.0, paged_MB=float(n),
                 cascade_branch_tokens_per_s=n / (sh / 1024), paged_branch_tokens_per_s=1 / (sh / 1024))
            for n in (1, 16) for sh in (1024, 4096)]
    s = dict(ch12.settings(True), branches=(1, 16), shared=(1024, 4096), dtypes=("float32",))
    v = ch12.values(dict(settings=s, attention=rows))["attention"]
    assert v["float32_n16_s4096"]["speedup"]["value"] == 16
    assert v["float32_hold"]["value"] == pytest.approx(0.25) and v["float32_paged_hold"]["value"] == pytest.approx(0.25)
