"""Speculative decoding (chapter 9 explains it): a draft guesses k tokens, the target checks them all in one
forward through its cache, and the cache takes back what was rejected.

Drafts (`bind(model, prompt)` once, then `propose(context, k) -> ids`) come from the context (`PromptLookup`) or
the target's own weights, over a smaller cache (`SelfDraft`) or through its first layers (`EarlyExit`); a draft
that runs a model rolls its own cache back too.
"""

import dataclasses
import time
from dataclasses import dataclass

import torch

from ..cache import CacheStateError, EvictingCache, make_cache
from ..models import forward_cached
from .backends import common_prefix
from .generate import check_count, check_counts
from .identity import token_ids


class SpecInputError(ValueError):
    """A speculative setting that cannot work: k or n below 1, a draft whose tokens the target cannot read."""


@dataclass
class SpecResult:
    tokens: list      # the new tokens, as plain greedy decoding would give them
    proposed: int     # draft tokens proposed
    accepted: int     # of them, accepted
    steps: int        # target forwards: the prefill, then one per verify step
    decode_seconds: float = float("nan")   # wall time after the prefill (drafting, verifying, rolling back)

    @property
    def acceptance(self) -> float:
        """Accepted over proposed draft tokens (nan when none were proposed)."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """New tokens per target forward after the prefill: 1 for plain decoding, up to k + 1."""
        return (len(self.tokens) - 1) / (self.steps - 1) if self.steps > 1 else float("nan")


def check_guess(guess: list, vocab_size: int):
    """A draft's guesses are token ids the target reads."""
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in guess):
        raise SpecInputError(f"the draft proposed ids outside the target's vocabulary of {vocab_size}: {guess}")


# ---- drafts ------------------------------------------------------------------------------------------------
class NoDraft:
    """Guesses nothing: speculative_generate then is plain decoding, one token per forward, through the same
    loop and cache (the baseline a speedup is measured against)."""

    def bind(self, model, prompt):
        pass

    def propose(self, context: list, k: int) -> list:
        return []


class PromptLookup:
    """Propose what followed the latest earlier occurrence of the context's last n tokens: no model at all.
    Pays on copy-heavy text (editing, summarising, code), where the answer repeats the prompt. transformers
    calls it `prompt_lookup_num_tokens`, vLLM the `ngram` method."""

    def __init__(self, n: int = 3):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpecInputError(f"PromptLookup's n must be an int of at least 1, got {n!r}")
        self.n = n

    def bind(self, model, prompt):
        pass

    def propose(self, context: list, k: int) -> list:
        n, tail = self.n, context[-self.n:]
        for i in range(len(context) - n - 1, -1, -1):           # latest match first, the tail itself excluded
            if context[i:i + n] == tail:
                return context[i + n:i + n + k]
        return []


class ModelDraft:
    """A draft that decodes greedily with a model of its own cache: `model_for(target)` says which (the same
    weights, or their first layers), `cache_factory()` the cache. Before each proposal its cache is cropped to the
    part the target accepted or, where it cannot go back that far (an evicting cache), emptied and filled again."""

    def __init__(self, cache_factory):
        if not callable(cache_factory):
            raise SpecInputError(f"cache_factory must be callable (no arguments -> a cache), got {cache_factory!r}")
        self.cache_factory, self.model, self.cache, self.ids = cache_factory, None, None, []
        self.rollbacks, self.positions = 0, 0       # crops of the draft's own cache; positions it ran

    def model_for(self, target):
        return target

    def bind(self, model, prompt):
        self.model = self.model_for(model)
        if self.model.config.vocab_size != model.config.vocab_size:
            raise SpecInputError(f"the draft reads {self.model.config.vocab_size} token ids, the target "
                                 f"{model.config.vocab_size}: they must share a vocabulary")
        self.cache, self.ids = self.new_cache(), []

    def new_cache(self):
        """An empty cache for the draft's model (bound by now)."""
        return self.cache_factory()

    def _sync(self, context):
        """Bring the cache to a prefix of context[:-1] (crop or reset), then run the rest but the last."""
        keep = common_prefix(self.ids, context[:-1])
        if keep < len(self.ids):
            try:
                self.cache.crop(keep)
            except CacheStateError:                # the position is gone (evicted): start over
                self.cache.reset()
                keep = 0
            self.ids, self.rollbacks = self.ids[:keep], self.rollbacks + 1
        if keep < len(context) - 1:
            self._run(context[keep:-1])

    def _run(self, ids):
        m = self.model
        logits = forward_cached(torch.tensor([ids], device=m.device), m.weights, m.config, self.cache,
                                last_only=True)
        self.ids, self.positions = self.ids + ids, self.positions + len(ids)
        return int(logits[0, -1].argmax())

    @torch.inference_mode()
    def propose(self, context: list, k: int) -> list:
        self._sync(context)
        out, last = [], context[-1]
        for _ in range(k):
            last = self._run([last])
            out.append(last)
        return out


class SelfDraft(ModelDraft):
    """The target's own weights over a smaller cache from `cache_factory()` (chapter 7's window,
    sinks, SnapKV or KIVI), as MagicDec, TriForce and QuantSpec draft."""


class EarlyExit(ModelDraft):
    """The target's first `layers` layers, then its final norm and head (LayerSkip without its training),
    over a StaticCache of those layers (`max_tokens` positions, by default as many as the model has)."""

    def __init__(self, layers: int, max_tokens: int | None = None):
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise SpecInputError(f"EarlyExit's layers must be an int of at least 1, got {layers!r}")
        self.layers, self.max_tokens = layers, max_tokens   # the cache's room, by default the model's positions
        super().__init__(self.new_cache)

    def new_cache(self):                        # this draft's own model: a copy bound elsewhere has its own
        return make_cache("static", self.model.config, self.max_tokens or self.model.config.max_positions)

    def model_for(self, target):
        if self.layers > target.config.n_layers:
            raise SpecInputError(f"EarlyExit({self.layers}): the target has {target.config.n_layers} layers")
        config = dataclasses.replace(target.config, n_layers=self.layers)
        return dataclasses.replace(target, config=config)


# ---- the verify loop ---------------------------------------------------------------------------------------
# region accept_greedy
def accept_greedy(logits, guess: list) -> list:
    """The guesses greedy decoding agrees with, and its own next token. logits `[len(guess) + 1, V]`
    are the target's, after its last token and after each guess."""
    greedy = logits.argmax(-1).tolist()                 # g_0 .. g_k
    a = 0
    while a < len(guess) and guess[a] == greedy[a]:
        a += 1
    return guess[:a] + [greedy[a]]
# endregion


def accept_sampled(p, q, guess, generator=None) -> list:
    """Speculative sampling's rejection rule (Leviathan et al. 2023, chapter 9): one verify step's tokens, as if
    sampled from the target. p `[k + 1, V]`: the target's probabilities after the context and after each guess;
    q `[k, V]`: the draft's, from which `guess` (k ids) was drawn (one-hot for a greedy draft)."""
    out = []
    for i, x in enumerate(guess):
        if torch.rand((), generator=generator) * q[i, x] < p[i, x]:       # u < p/q, without dividing by 0
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
    return out + [int(torch.multinomial(p[len(guess)], 1, generator=generator))]


@torch.inference_mode()
def speculative_generate(model, ids, max_new_tokens: int, draft, k: int = 4, cache="static",
                         temperature: float = 0.0, generator=None) -> SpecResult:
    """Decoding of max_new_tokens after `ids`, k draft tokens checked per target forward, through `cache`: a design
    name for `make_cache` ("static", "paged", "concat") or a callable returning a cache (an EvictingCache is
    refused). Greedy (temperature 0): the same tokens as plain greedy decoding through the same cache design.
    Sampling (`generator` for repeatable draws): `accept_sampled`, q one-hot at the draft's guess."""
    check_count("max_new_tokens", max_new_tokens)
    check_counts(SpecInputError, k=k)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise SpecInputError(f"temperature must be a number of at least 0, got {temperature!r}")
    prompt, cfg = token_ids(ids).tolist(), model.config
    room = min(len(prompt) + max_new_tokens + k, cfg.max_positions)
    target = cache() if callable(cache) else make_cache(cache, cfg, room)
    if isinstance(target, EvictingCache):
        raise SpecInputError("an evicting cache cannot verify drafts: it evicts after each forward, so the k + 1 "
                             "tokens of a verify chunk attend to positions plain decoding would have dropped, and "
                             "a crop cannot bring back what the chunk evicted; give it to SelfDraft instead")
    draft.bind(model, prompt)
    run = lambda chunk, last_only=False: forward_cached(torch.tensor([chunk], device=model.device), model.weights,
                                                        cfg, target, last_only=last_only)[0]   # [T, V]
    if temperature:
        def choose(logits, guess):               # [len(guess) + 1, V] -> the kept guesses and one drawn token
            p = torch.softmax(logits.float() / temperature, -1)
            q = torch.nn.functional.one_hot(torch.tensor(guess, dtype=torch.long), p.shape[-1]).float()
            return accept_sampled(p, q, guess, generator)
    else:
        choose = accept_greedy
    tokens, proposed, accepted = choose(run(prompt, last_only=True), []), 0, 0    # the prefill gives the first token
    steps, t0 = 1, time.perf_counter()
    while len(tokens) < max_new_tokens:
        context = prompt + tokens
        limit = min(k, max_new_tokens - len(tokens) - 1, cfg.max_positions - len(context))
        guess = list(draft.propose(context, limit))[:limit] if limit > 0 else []
        check_guess(guess, cfg.vocab_size)
        # region verify
        start = len(context) - 1                        # the cache holds context[:-1]
        new = choose(run([context[-1]] + guess), guess)  # one forward: t and the guesses
        a = len(new) - 1                                # guesses kept
        target.crop(start + 1 + a)                      # keep t and the kept guesses: the rest vanish
        tokens += new
        # endregion
        proposed, accepted, steps = proposed + len(guess), accepted + a, steps + 1
    return SpecResult(tokens[:max_new_tokens], proposed, accepted, steps, time.perf_counter() - t0)
