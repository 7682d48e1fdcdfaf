"""ChatSession: a conversation on one backend, the chat template applied every turn.

Oracles: the same conversation on a RecomputeBackend (no cache) must give the same replies, token for
token; what a prefix-caching backend reuses of a turn's prompt follows from the longest common prefix with
the previous prompt and reply, rounded down to whole pages (the rest of the last page is computed again).
"""

import pytest

from lab.engine import ChatSession, PrefixCachingBackend, RecomputeBackend, common_prefix

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_a_cached_chat_says_what_recomputation_says_and_reuses_whole_pages(smollm2):
    system, P = "You answer in one short sentence.", 16
    cached = ChatSession(smollm2, PrefixCachingBackend(smollm2, 64, P), system=system, max_new_tokens=6)
    plain = ChatSession(smollm2, RecomputeBackend(smollm2), system=system, max_new_tokens=6)
    for q in QUESTIONS:
        assert cached.say(q) == plain.say(q)
    assert cached.turns[0]["reused_tokens"] == 0                    # nothing was cached before
    for turn in cached.turns[1:]:
        shared = min(turn["common_prefix"], turn["prompt_tokens"] - 1)  # at least one token is run
        assert turn["common_prefix"] > 0 and turn["reused_tokens"] == shared // P * P
    assert [t["reused_tokens"] for t in plain.turns] == [0, 0, 0]   # no cache, no reuse


def test_a_model_without_a_chat_template_is_refused():
    from lab.models import load

    model = load("tiny-llama")
    with pytest.raises(ValueError, match="no chat template"):
        ChatSession(model, RecomputeBackend(model)).say("hi")
