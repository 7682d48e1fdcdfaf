"""Chapter 6's measurements: the workloads, the hit-rate sweep, ROC AUC and the cost of a conversation.

Oracles: for hit rates, a pool that never evicts worked out with sets of page contents (a page is reusable
once any earlier request filled it); for AUC, counting every (right, wrong) pair; for costs, the price
sheet applied by hand to a three-turn conversation.
"""

import random

import pytest

from lab import metrics, workloads
from lab.experiments import ch06_prefix as ch06
from lab.models import load


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def never_evicting(requests, P):
    """Tokens each request finds cached in an unbounded pool: its longest run of full pages, at most
    (len - 1) // P, each filled by some earlier request (a page is named by every token up to its end)."""
    seen, out = set(), []
    for ids in requests:
        n = 0
        while n < (len(ids) - 1) // P and tuple(ids[:(n + 1) * P]) in seen:
            n += 1
        out.append(n * P)
        seen |= {tuple(ids[:(i + 1) * P]) for i in range(len(ids) // P)}
    return out


@pytest.mark.parametrize("name", list(workloads.WORKLOADS))
def test_hit_rate_of_a_pool_that_never_evicts_is_the_set_oracles(tiny, name):
    requests = workloads.WORKLOADS[name](tiny.config.vocab_size, scale=0.1)
    r = workloads.hit_rate(tiny, requests, num_pages=sum(-(-len(x) // 16) for x in requests))
    want = never_evicting(requests, 16)
    assert r["cached_tokens"] == sum(want) and r["evicted_pages"] == 0
    assert r["cached_tokens"] + r["computed_tokens"] == sum(len(x) for x in requests)


def test_a_smaller_pool_never_serves_more_and_evicts(tiny):
    requests = workloads.shared_system_prompts(tiny.config.vocab_size, scale=0.2)
    sweep = workloads.hit_rate_sweep(tiny, {"s": requests}, (0.05, 0.3, 1.0))["s"]["runs"]
    rates = [r["hit_rate"] for r in sweep]
    assert rates == sorted(rates) and rates[0] < rates[-1] and sweep[0]["evicted_pages"] > 0


def test_workloads_have_their_shapes():
    chats = workloads.multi_turn_chats(1000, scale=0.1, turns=3)
    by_start, system = {}, chats[0][:300]
    for ids in chats:
        assert ids[:300] == system                               # one system prompt for every chat
    for ids in chats:                                            # every turn extends an earlier prompt
        earlier = [x for x in by_start.values() if ids[:len(x)] == x]
        by_start[tuple(ids)] = ids
        assert len(ids) > 300 and (earlier or len(ids) <= 300 + 120)
    few = workloads.few_shot_prompts(1000, scale=0.2)
    assert len({tuple(x[:60]) for x in few}) == 4                # four tasks' instructions
    assert workloads.few_shot_prompts(1000, scale=0.2) == few         # seeded
    chat = dict(system=50, turns=4, user=7, reply=11)
    turns = workloads.conversation(1000, **chat)
    assert [len(x) for x in turns] == ch06.chat_prompts(**chat)            # the lengths the price sheet charges
    assert all(b[:len(a)] == a for a, b in zip(turns, turns[1:], strict=False))  # each turn resends the last


@pytest.mark.parametrize("labels, scores, auc", [
    ([1, 1, 0, 0], [4, 3, 2, 1], 1.0), ([1, 1, 0, 0], [1, 2, 3, 4], 0.0), ([1, 0], [5, 5], 0.5),
    ([1, 0, 1, 0], [4, 3, 2, 1], 0.75)])
def test_auc_counts_pairs(labels, scores, auc):
    assert metrics.roc(labels, scores)["auc"] == auc


def test_auc_equals_counting_pairs_on_random_scores():
    rng = random.Random(0)
    labels = [rng.random() < 0.5 for _ in range(60)]
    scores = [rng.randrange(10) for _ in range(60)]
    right = [a for a, la in zip(scores, labels, strict=True) if la]
    wrong = [b for b, lb in zip(scores, labels, strict=True) if not lb]
    pairs = [(a > b) + 0.5 * (a == b) for a in right for b in wrong]
    r = metrics.roc(labels, scores)
    assert r["auc"] == pytest.approx(sum(pairs) / len(pairs))
    assert r["fpr"][0] == r["tpr"][0] == 0 and r["fpr"][-1] == r["tpr"][-1] == 1


CHAT = dict(system=2000, turns=3, user=100, reply=300, minutes_between=10.0)   # prompts 2100, 2500, 2900


def test_anthropic_cost_by_hand():
    p = ch06.PRICES["Anthropic, 5-minute cache"]
    base = p["base"] / 1e6
    want = base * (1.25 * 2100 + (0.1 * 2100 + 1.25 * 400) + (0.1 * 2500 + 1.25 * 400))
    c = ch06.conversation_cost(p, CHAT)
    assert c["cached"] == pytest.approx(want) and c["without"] == pytest.approx(base * (2100 + 2500 + 2900))


def test_openai_cost_by_hand_matches_in_128_token_steps():
    p = ch06.PRICES["OpenAI, automatic"]
    base = p["base"] / 1e6
    hits = [0, 2048, 2432]                                       # 1,024 + 128 k, at most the last prompt
    want = base * sum(0.25 * h + (n - h) for h, n in zip(hits, (2100, 2500, 2900), strict=True))
    assert ch06.conversation_cost(p, CHAT)["cached"] == pytest.approx(want)


def test_gemini_cost_by_hand_stores_the_system_prompt():
    p = ch06.PRICES["Gemini, explicit cache"]
    base, hours = p["base"] / 1e6, 3 * 10 / 60
    chat = CHAT | {"system": 3000}                               # above Gemini's 2,048-token minimum
    prompts = (3100, 3500, 3900)
    want = base * (3000 + sum(0.1 * 3000 + n - 3000 for n in prompts)) + 4.5 / 1e6 * 3000 * hours
    assert ch06.conversation_cost(p, chat)["cached"] == pytest.approx(want)
    # below the minimum nothing is cached: the cost is the uncached one
    assert ch06.conversation_cost(p, CHAT)["cached"] == pytest.approx(ch06.conversation_cost(p, CHAT)["without"])
