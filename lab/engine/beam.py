"""Beam search on copy-on-write pages, the beams sequences of one PagePool (chapter 12 explains it).

The choice of beams is transformers' `_beam_search` (generation/utils.py, v5.23.0) for one prompt:
- candidates: top 2 * num_beams of beam score + log_softmax(logits), flattened beam-major (torch.topk);
- a candidate ending in eos_id, or reaching max_new_tokens, is a finished hypothesis only if ranked among the
  first num_beams; its score is its summed log-prob / n ** length_penalty, n its new tokens (the eos counted);
  the best num_beams hypotheses are kept;
- the next beams are the num_beams best candidates that did not finish;
- once num_beams hypotheses are kept, the search stops if early_stopping is True, or if the best running beam's
  score / L ** length_penalty is no better than the worst hypothesis: L is the beams' current length, or
  max_new_tokens with early_stopping="never" and length_penalty > 0.
"""

import math
import numbers
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..cache.pool import PagePool
from ..models import InputError, PositionLimitError, forward_cached, owner
from .generate import check_counts
from .identity import token_ids


@dataclass
class BeamResult:
    sequences: list   # the finished hypotheses' new tokens, best first: num_beams lists of ints
    scores: list      # their scores, summed log-probs / (new tokens) ** length_penalty (transformers' sequences_scores)
    stats: dict = field(default_factory=dict)   # per decode step: see beam_search


@torch.inference_mode()
def beam_search(model, ids, num_beams: int, max_new_tokens: int, length_penalty: float = 1.0,
                early_stopping: bool | str = False, eos_id: int | None = None, page_size: int = 16,
                num_pages: int | None = None) -> BeamResult:
    """Beam search from `ids` (a list, `[T]` or `[1, T]`), as transformers' generate(num_beams=...,
    do_sample=False, num_return_sequences=num_beams). eos_id None: no token ends a hypothesis early
    (transformers takes SmolLM2's from its config: 2). num_pages: by default enough for 2 * num_beams
    sequences of the full length. stats, per decode step: held_pages (during the step's forward), forks,
    copied_pages and copied_bytes (copy on write), index_select_bytes (what transformers' reordering of
    every beam's whole cache copies at the same step)."""
    cfg = model.config
    prompt = token_ids(ids, cfg.vocab_size).tolist()
    P, k, T = len(prompt), num_beams, max_new_tokens
    _check(cfg, P, k, T, length_penalty, early_stopping, eos_id, page_size, num_pages)
    pages = -(-(P + T) // page_size)                           # one sequence of the full length
    need = k * -(-(P + T - 1) // page_size)                    # every beam's pages, none shared
    if num_pages is not None and num_pages < need:
        raise InputError(f"num_pages={num_pages}: {k} beams of {P + T - 1} positions may hold {need} pages")
    pool = PagePool.for_model(cfg, num_pages or 2 * k * pages, page_size, dtype=model.dtype, device=model.device)
    state, device = owner(model.weights, cfg), model.device
    layers, H, D = cfg.kv_layout
    position_bytes = 2 * layers * H * D * pool.dtype.itemsize  # keys and values of one position, every layer

    def forward(parts, tokens, rows):
        """Reserve and run one step of `parts` (seq, n) -> log-probs at `rows` of `tokens` [rows, V], copies."""
        copies = pool.reserve(parts)                          # copy on write: a shared, partly filled last page
        step = pool.plan_step(parts)
        logits = forward_cached(torch.tensor([tokens], device=device), model.weights, cfg, step,
                                positions=step.positions, state=state,
                                logits_at=torch.tensor(rows, device=device))   # [1, rows, V]
        return torch.log_softmax(logits[0].float(), dim=-1), copies

    seqs, hyps, scores = [pool.new_id()], [[]], torch.zeros(1)     # the live beams: one, the prompt
    logp, _ = forward([(seqs[0], P)], prompt, [P - 1])                # prefill once: [1, V]
    finished, stats = [], dict(held_pages=[], forks=[], copied_pages=[], copied_bytes=[], index_select_bytes=[])
    for t in range(1, T + 1):                                  # t: the new tokens of each candidate
        # region beam_step
        top, at = torch.topk((logp + scores[:, None]).flatten(), 2 * k)   # [2k], best first
        V = logp.shape[-1]
        src, tok = (at // V).tolist(), (at % V).tolist()
        penalized = (top / t ** length_penalty).tolist()     # in float32, as transformers
        nxt = []                                    # (rank, beam, token) of the next beams
        for rank, (b, x) in enumerate(zip(src, tok, strict=True)):
            if x == eos_id or t == T:               # ends: a hypothesis if among the first k
                if rank < k:
                    finished.append((penalized[rank], hyps[b] + [x]))
            elif len(nxt) < k:
                nxt.append((rank, b, x))
        finished = sorted(finished, key=lambda f: -f[0])[:k]    # stable: the earlier first on a tie
        if t == T or len(finished) == k and _done(top[nxt[0][0]], finished[-1][0], t, T,
                                                  length_penalty, early_stopping):
            break
        # move the pages: release the beams no candidate continues, fork those continued twice
        chosen = Counter(b for _, b, _ in nxt)
        for b, seq in enumerate(seqs):
            if not chosen[b]:
                pool.manager.release(seq)
        taken, new_seqs = set(), []
        for _, b, _ in nxt:
            new_seqs.append(pool.fork(seqs[b]) if b in taken else seqs[b])
            taken.add(b)
        seqs, hyps = new_seqs, [hyps[b] + [x] for _, b, x in nxt]
        scores = top[[r for r, _, _ in nxt]]                   # [k]
        logp, copies = forward([(s, 1) for s in seqs], [x for _, _, x in nxt], list(range(k)))
        # endregion
        stats["held_pages"].append(sum(pool.held_pages().values()))
        stats["forks"].append(k - len(taken))
        stats["copied_pages"].append(len(copies))
        stats["copied_bytes"].append(len(copies) * page_size * position_bytes)   # a page, every layer's K and V
        stats["index_select_bytes"].append(k * (P + t - 1) * position_bytes)  # the cache before this token
    for seq in seqs:
        pool.manager.release(seq)
    return BeamResult([h for _, h in finished], [s for s, _ in finished], stats)


def _done(best_running, worst_kept, t, T, length_penalty, early_stopping) -> bool:
    """With num_beams hypotheses kept: stop (transformers' _check_early_stop_heuristic, in float32)?"""
    if early_stopping is True:
        return True
    n = T if early_stopping == "never" and length_penalty > 0 else t
    return not float(best_running / n ** length_penalty) > worst_kept


def _check(cfg, P, k, T, length_penalty, early_stopping, eos_id, page_size, num_pages):
    """Every argument, before anything is built."""
    check_counts(InputError, num_beams=k, max_new_tokens=T, page_size=page_size,
                 num_pages=1 if num_pages is None else num_pages)
    if 2 * k > cfg.vocab_size:
        raise InputError(f"num_beams={k}: 2 * num_beams candidates exceed the vocabulary of {cfg.vocab_size}")
    if (isinstance(length_penalty, bool) or not isinstance(length_penalty, numbers.Real)
            or not math.isfinite(length_penalty)):
        raise InputError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise InputError(f'early_stopping is True, False or "never", got {early_stopping!r}')
    if eos_id is not None and not (isinstance(eos_id, int) and not isinstance(eos_id, bool)
                                   and 0 <= eos_id < cfg.vocab_size):
        raise InputError(f"eos_id must be None or a token id in 0 .. {cfg.vocab_size - 1}, got {eos_id!r}")
    if P + T - 1 > cfg.max_positions:                          # the last new token is never fed back
        raise PositionLimitError(f"{P} prompt tokens and {T} new ones need {P + T - 1} positions; "
                                 f"{cfg.name or cfg.arch} has {cfg.max_positions}")
