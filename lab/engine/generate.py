"""The generation loop: greedy decoding through any backend, timed per step."""

import numbers
import time
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from .identity import token_ids


@dataclass
class Generation:
    tokens: list                                   # the new tokens only
    step_seconds: list = field(default_factory=list)  # [0] is prefill (time to first token), then decode steps

    @property
    def ttft(self) -> float:
        """Time to first token: the prefill step."""
        return self.step_seconds[0]

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (the decode steps)."""
        rest = self.step_seconds[1:]
        return sum(rest) / len(rest) if rest else float("nan")


def generate(backend, prompt_ids, max_new_tokens: int, stop_ids=(), progress=False) -> Generation:
    """Greedy decoding: append argmax(next_logits(ids)) until max_new_tokens or a stop token."""
    check_count("max_new_tokens", max_new_tokens)
    ids, out = token_ids(prompt_ids).tolist(), Generation([])
    for _ in tqdm(range(max_new_tokens), desc="generate", disable=not progress):
        t0 = time.perf_counter()
        token = int(backend.next_logits(ids).argmax())
        out.step_seconds.append(time.perf_counter() - t0)
        ids.append(token)
        out.tokens.append(token)
        if token in stop_ids:
            break
    return out


def greedy_agreement(backend, reference, prompts, new_tokens: int) -> dict:
    """Generate every prompt greedily through `backend` and through `reference` (e.g. a RecomputeBackend):
    tokens_identical (for every prompt), positions (what each request pushed through `backend`) and
    recompute_positions (through `reference`, per request, on average)."""
    same, per_request, before_ref = True, [], reference.positions
    for p in prompts:
        before = backend.positions
        tokens = generate(backend, p, new_tokens).tokens
        per_request.append(backend.positions - before)
        same &= tokens == generate(reference, p, new_tokens).tokens
    return dict(tokens_identical=same, positions=per_request,
                recompute_positions=(reference.positions - before_ref) // len(prompts))


def check_count(name: str, n, low: int = 1):
    """A count (of tokens, of steps) is an int of at least `low`: True is not 1, and 2.5 is no count."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")
    if n < low:
        raise ValueError(f"{name} must be at least {low}, got {n}")


def check_counts(error, **counts):
    """Each count (name=value) is an int of at least 1; else `error` names the first that is not."""
    for name, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise error(f"{name} must be an int of at least 1, got {n!r}")


def positions_uncached(prompt_len: int, new_tokens: int) -> int:
    """Positions processed without a cache: step s (0-based) recomputes prompt_len + s positions,
    and sum_{s=0}^{n-1} (P + s) = n*P + n*(n-1)/2, quadratic in the number of new tokens."""
    P, n = prompt_len, new_tokens
    return n * P + n * (n - 1) // 2


def positions_cached(prompt_len: int, new_tokens: int) -> int:
    """Positions processed with a cache: the prompt once (prefill), then one per later token: P + n - 1."""
    return prompt_len + new_tokens - 1
