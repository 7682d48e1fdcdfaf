"""ServingEngine: continuous batching over one pool of pages (chapter 8 explains its scheduler).

With a `draft` (chapter 9), a decode's guesses take lookahead pages from the free pages only (speculation never
preempts) and are cropped back to the accepted tokens before a page is named. A radix tree (chapter 11) and local
layers (chapter 10) share the pool, step and kernel. Time is counted in steps: runs are deterministic.
"""

import copy
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache import CacheInputError, CacheMismatchError, OutOfPagesError
from ..cache.pool import PagePool, StepBatch
from ..models import InputError, PositionLimitError, forward_cached, owner
from ..models.llama import Prepacked
from .backends import common_prefix
from .fast import ROWS, FusedStep
from .generate import check_counts
from .identity import identity_of, token_ids
from .speculative import SpecInputError, check_guess

GREEDY_BELOW = 1e-5     # a temperature below this decodes greedily, as vLLM's (softmax(logits / T) overflows)


class EngineStateError(RuntimeError):
    """A step that would run on the leftovers of a failed one (see ServingEngine.step)."""


@dataclass(eq=False)                       # compared by identity: a request is one object
class Request:
    """One request: its prompt, what it generated so far, where it stands, and when things happened to it."""

    id: int
    prompt: list                           # the ids given
    max_new_tokens: int
    eos_id: int | None = None              # stop after this token (it is kept in the output)
    output: list = field(default_factory=list)  # the tokens generated so far
    state: str = "waiting"                 # waiting, running, branch (waits for a fork), finished, cancelled
    seq: int | None = None                 # its sequence in the block manager, while it holds pages
    computed: int = 0                      # leading positions of prompt + output held in its pages
    keys: list = field(default_factory=list)    # (digest, parent, tokens) of its full pages, as far as known
    named: int = 0                         # its leading pages named in the manager (or taken from its cache)
    cached_tokens: int = 0                 # positions taken from cached pages, over every admission
    draft: object = None                   # its own copy of the engine's draft, while it runs
    temperature: float = 0.0               # 0: greedy; else sampled from softmax(logits / temperature)
    generator: object = None               # its own torch.Generator (seeded), or None: torch's global one
    branches: list = field(default_factory=list)  # requests of its `n` that fork its pages at its first token
    parent: object = None                  # a branch's first request, which prefills for it
    guess: list = field(default_factory=list)   # the draft tokens scheduled in this step
    events: dict = field(default_factory=dict)  # step numbers, for a timeline (see ServingEngine.timeline)

    @property
    def tokens(self) -> list:              # everything its next token depends on
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return self.state in ("finished", "cancelled")


class ServingEngine:
    """Greedy decoding of many requests at once over one pool of `num_pages` pages of `page_size`.

    prefix_caching: True or "hash" (chapter 6's page names), "radix" (a RadixCache: to the token with page_size=1),
    or False. schedule: "fcfs" or, with prefix caching, "lpm" (longest cached prefix first, SGLang's policy).
    local_pages: the local layers' pages (chapter 10; default num_pages), at least a one-token step's; a chunk
    shrinks to fit. fast_decode: a step of a few decodes only runs in one C++ call where it applies (fast.py): True
    takes up to rows_for(dtype) decodes, an int (0 to ROWS) up to that many in any dtype, "measure" as many as
    FusedStep.tune finds it no slower for on this machine (a few seconds for SmolLM2, at start); False runs every
    step through forward_cached.

    `stats`: totals of steps, preemptions, cached_tokens (from named pages), computed_tokens (run through the
    model, recomputation included), evicted_pages; held_pages and peak_held_pages per group ({"full": n, "local":
    m}); per step, batch_sizes, batch_tokens, step_times; with a draft, proposed and accepted (draft tokens),
    lookahead_pages and rollback_pages (reserved for guesses, freed after checking)."""

    def __init__(self, model, num_pages: int, page_size: int = 16, max_batch_tokens: int = 256,
                 prefix_caching: bool | str = True, draft=None, k: int = 4, local_pages: int | None = None,
                 schedule: str = "fcfs", fast_decode: bool | int | str = True):
        cfg = model.config
        if prefix_caching not in (True, False, "hash", "radix"):
            raise CacheInputError(f'prefix_caching is True or "hash" (page names), "radix" or False, '
                                  f"got {prefix_caching!r}")
        if schedule not in ("fcfs", "lpm") or (schedule == "lpm" and not prefix_caching):
            raise CacheInputError(f'schedule is "fcfs" or, with prefix caching, "lpm", got {schedule!r}')
        check_counts(CacheInputError, num_pages=num_pages, page_size=page_size,
                     max_batch_tokens=max_batch_tokens,
                     local_pages=1 if local_pages is None else local_pages)
        if max_batch_tokens > cfg.max_positions:     # a step's tokens go through the forward as one row
            raise CacheInputError(f"max_batch_tokens {max_batch_tokens} exceeds the model's "
                                  f"{cfg.max_positions} positions")
        if draft is not None and not all(callable(getattr(draft, f, None)) for f in ("bind", "propose")):
            raise SpecInputError(f"a draft has bind(model, prompt) and propose(context, k), got {draft!r}")
        check_counts(SpecInputError, k=k)
        self.model, self.page_size, self.max_batch_tokens = model, page_size, max_batch_tokens
        self.draft, self.k = draft, k
        self.prefix_caching, self.schedule = bool(prefix_caching), schedule
        if cfg.kv_rank and not cfg.kv_absorbed:
            raise CacheInputError("the reconstructing form rebuilds every key and value from one sequence's whole "
                                  "cache; the engine's pages serve the absorbed form of the same model (latent_kv)")
        index = "radix" if prefix_caching == "radix" else "hash" if prefix_caching else None
        self.pool = PagePool.for_model(cfg, num_pages, page_size, local_pages, index, model.dtype, model.device)
        self.manager = self.pool.manager             # which page holds which position, with reference counts
        self.owner = owner(model.weights, cfg)       # the weights' state the pages are computed with
        # Llama weights on a CPU (float32, or bfloat16 where oneDNN runs it natively): the projections also
        # prepacked for oneDNN, q, k, v and gate, up merged, as vLLM's CPU backend holds them
        packs = cfg.arch != "gpt2" and Prepacked.applies(model.weights)
        self.weights = Prepacked(model.weights) if packs else model.weights
        # a step of a few decodes in one C++ call where it applies (fast.py); every other step: forward_cached
        if not (isinstance(fast_decode, bool) or fast_decode == "measure" or
                (type(fast_decode) is int and 0 <= fast_decode <= ROWS)):
            raise CacheInputError(f'fast_decode is True, False, a number of decodes from 0 to {ROWS} or "measure", '
                                  f"got {fast_decode!r}")
        rows = None if isinstance(fast_decode, bool | str) else fast_decode
        self.fast = FusedStep.build(model, self.pool, rows) if fast_decode is not False else None
        if self.fast and fast_decode == "measure":
            self.fast.tune(self.weights, self.owner)
        # page names chain from the state identity, as PrefixCachingBackend's do (with no salt)
        self.extra = (identity_of(model, self.pool),) if self.prefix_caching else None
        self.manager.extra = self.extra or ()
        self.requests = {}                           # id -> Request, every request ever added
        self.waiting = deque()                       # first come, first served
        self.running = []                            # in order of admission: the last is the youngest
        self._ids = itertools.count()
        self.tainted, self.failure = [], None         # requests in flight when a step raised, and why
        self.stats = dict(steps=0, preemptions=0, cached_tokens=0, computed_tokens=0, evicted_pages=0,
                          batch_sizes=[], batch_tokens=[], step_times=[], proposed=0, accepted=0, lookahead_pages=0,
                          rollback_pages=0, held_pages=self.pool.held_pages(), peak_held_pages=self.pool.held_pages())

    @property
    def num_pages(self) -> int:                      # pages of the first group (the global layers')
        return self.manager.num_pages[self.manager.groups[0]]

    # ---- requests in and out ----
    def add_request(self, ids, max_new_tokens: int, eos_id: int | None = None, n: int = 1,
                    temperature: float = 0.0, seed: int | None = None) -> int:
        """Queue one request (ids: a list, `[T]` or `[1, T]`); returns its id. A bad request raises and leaves the
        engine as it was. n > 1 asks for n answers (parallel sampling, chapter 12): requests rid .. rid + n - 1,
        forked from the first at its first token. temperature > 0 samples from softmax(logits / temperature) (below
        GREEDY_BELOW, greedily), each answer with its own generator, seeded seed + i given a seed. Cancelling the
        first before its first token cancels the n."""
        return self._add(self._check(ids, max_new_tokens, eos_id, n, temperature, seed))

    def cancel(self, rid: int) -> bool:
        """Drop a request and free its pages; False if it had already finished or been cancelled."""
        if isinstance(rid, bool) or not isinstance(rid, int):   # True == 1 and 2.0 == 2 would find a request
            raise InputError(f"a request id is an int, got {type(rid).__name__} {rid!r}")
        if rid not in self.requests:
            raise KeyError(f"no request with id {rid!r}")
        req = self.requests[rid]
        if req.done:
            return False
        if req.state == "running":
            self._release(req)
        elif req.state == "waiting":
            self.waiting.remove(req)
        elif req.state == "branch":                   # not forked yet: its first goes on without it
            req.parent.branches.remove(req)
        for r in [req, *req.branches]:                # the first before its first token: its n too
            r.state, r.events["cancelled"] = "cancelled", self.stats["steps"]
        req.branches = []
        return True

    def output(self, rid: int) -> list:
        """The tokens request `rid` has generated so far."""
        return list(self.requests[rid].output)

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens, arrivals=None, eos_id=None) -> list[list[int]]:
        """Greedy continuations of `prompts` (id lists), each up to `max_new_tokens` (an int, or one
        per prompt); prompt i arrives before the `arrivals[i]`-th step of this call (`drive`)."""
        return [self.output(r) for r in drive(self, prompts, max_new_tokens, arrivals, eos_id)]

    def timeline(self) -> list[dict]:
        """Per request, its sizes and what happened at which step: arrived, admitted [steps], chunks [(step,
        tokens)] of prefill (recomputation included), first_token, preempted [steps], finished or cancelled."""
        return [dict(id=r.id, prompt_tokens=len(r.prompt), output_tokens=len(r.output),
                     max_new_tokens=r.max_new_tokens, state=r.state,
                     cached_tokens=r.cached_tokens, **r.events) for r in self.requests.values()]

    def _check(self, ids, max_new_tokens, eos_id, n=1, temperature=0.0, seed=None) -> list[Request]:
        """The n requests of a prompt checked against the model and the pool (not yet added: with no id)."""
        cfg = self.model.config
        if isinstance(ids, int):
            raise InputError(f"a prompt is a sequence of token ids, got the single int {ids}")
        prompt = token_ids(ids, cfg.vocab_size).tolist()          # InputError: empty, not ints, out of vocab
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
            raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)
                                   or not 0 <= eos_id < cfg.vocab_size):
            raise InputError(f"eos_id must be None or a token id in 0 .. {cfg.vocab_size - 1}, got {eos_id!r}")
        positions = len(prompt) + max_new_tokens - 1              # the last token is never fed back
        if positions > cfg.max_positions:
            raise PositionLimitError(f"{len(prompt)} prompt + {max_new_tokens} new tokens need {positions} "
                                     f"positions; the model has {cfg.max_positions}")
        check_counts(InputError, n=n)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < 1e6:
            raise InputError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63 - n):
            raise InputError(f"seed must be None or an int >= 0, got {seed!r}")
        if temperature and self.draft is not None:
            raise SpecInputError("the engine verifies a draft's guesses greedily: sampling (temperature > 0) "
                                 "needs an engine without a draft")
        P, pages = self.page_size, -(-positions // self.page_size)
        # the first holds them all; another answer, its own pages past the prompt's full ones, if it writes any
        total = pages + (n - 1) * (pages - len(prompt) // P if positions > len(prompt) else 0)
        if total > self.manager.num_pages.get("full", total):   # never held at once (a local group: a window)
            raise OutOfPagesError(f"{len(prompt)} prompt + {max_new_tokens} new tokens need {pages} pages of "
                                  f"{P}" + (f", and {n} answers {total}" if n > 1 else "")
                                  + f"; the pool has {self.num_pages}")
        generators = [None if seed is None else torch.Generator().manual_seed(seed + i) for i in range(n)]
        temperature = float(temperature) if temperature >= GREEDY_BELOW else 0.0   # logits / T would overflow
        return [Request(-1, prompt, max_new_tokens, eos_id, temperature=temperature, generator=g) for g in generators]

    def _add(self, reqs: list) -> int:
        """Give a prompt's n requests (`_check`'s) ids and queue the first (returned); the others wait to fork."""
        for req in reqs:
            req.id = next(self._ids)
            req.events = dict(arrived=self.stats["steps"], admitted=[], chunks=[], first_token=None, preempted=[],
                              finished=None, cancelled=None, verify=[])
            self.requests[req.id] = req
        first, *branches = reqs
        self.waiting.append(first)
        for branch in branches:
            branch.state, branch.parent = "branch", first
        first.branches = branches
        return first.id

    # ---- one step ----
    @torch.inference_mode()
    def step(self) -> dict[int, list]:
        """One scheduler iteration: schedule, one forward, sample. Returns {request id: [its new tokens]}: one
        token per request, or with a draft the accepted guesses and one more. A step that raises taints every
        request then in flight: later steps raise EngineStateError until each is cancelled or finished. Cached
        pages hold only finished steps' keys and values, so requests added afterwards run as in a fresh engine."""
        if owner(self.model.weights, self.model.config) != self.owner:
            raise CacheMismatchError("the model's weights changed since this engine's pages were computed: "
                                     "its keys and values are not this model's; use a new engine")
        if stale := [r for r in self.tainted if not self.requests[r].done]:
            raise EngineStateError(f"an earlier step failed ({self.failure}) after reserving slots and pages it "
                                   f"never filled: requests {stale} may now decode from wrong keys and values. "
                                   f"Cancel them (their tokens so far are right) or use a new engine")
        now, began = self.stats["steps"], time.perf_counter()
        try:
            batch = self._schedule(now)                               # [(request, tokens this step)]
            new = self._run(batch, now) if batch else {}
        except BaseException as e:                                    # the pages are half-changed: no request
            self.tainted = [r.id for r in self.running + list(self.waiting)]   # in flight may step again
            self.failure = f"{type(e).__name__}: {e}"
            raise
        s = self.stats
        s["steps"] += 1
        s["batch_sizes"].append(len(batch))
        s["batch_tokens"].append(sum(n for _, n in batch))
        s["step_times"].append((began, time.perf_counter()))
        s["evicted_pages"] = self.manager.evicted
        s["held_pages"] = self.pool.held_pages()          # group -> pages the running requests hold
        s["peak_held_pages"] = {g: max(n, s["peak_held_pages"][g]) for g, n in s["held_pages"].items()}
        return new

    def _schedule(self, now) -> list:
        """Decodes first, then prefill chunks, then new requests, within the token budget; pages
        reserved."""
        budget, scheduled, preemptions = self.max_batch_tokens, {}, self.stats["preemptions"]
        decoding = [r for r in self.running if r.num_tokens - r.computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.computed > 1]
        for req in decoding + prefilling:
            n = min(req.num_tokens - req.computed, budget)
            if n > 1 and req.state == "running":                  # a chunk takes what free pages hold
                room = self.pool.room(req.seq)                    # the length its pages can reach
                if room == req.computed and scheduled:
                    continue                                      # no room: it waits while others run
                n = min(n, room - req.computed) or n
            while req.state == "running" and n:                   # (skips a request preempted above)
                try:
                    self.pool.reserve([(req.seq, n)])
                    scheduled[req], budget = n, budget - n
                    break
                except OutOfPagesError:                           # the youngest gives its pages back
                    victim = self.running[-1]
                    budget += scheduled.pop(victim, 0)
                    self._preempt(victim, now)
        if self.draft is not None:
            budget = self._lookahead(decoding, scheduled, budget)
        while self.waiting and budget and self.stats["preemptions"] == preemptions:
            req = self.next_to_admit()
            if req not in self.waiting:
                raise RuntimeError(f"next_to_admit() chose {req!r}, which is not waiting")
            n = self._admit(req, budget, now)
            if not n:
                break                                                 # no overtaking the one chosen
            self.waiting.remove(req)
            self.running.append(req)
            scheduled[req], budget = n, budget - n
        return list(scheduled.items())

    def _lookahead(self, decoding, scheduled, budget) -> int:
        """Each decode scheduled gets its draft's guesses, as many as the budget, its output's room and the
        free pages allow (never a preemption); their pages are reserved. Returns the budget left."""
        cfg = self.model.config
        for req in decoding:
            if req.state != "running" or scheduled.get(req) != 1:
                continue
            room = self.pool.room(req.seq) - req.computed - 1
            limit = min(self.k, budget, room, req.max_new_tokens - len(req.output) - 1,
                        cfg.max_positions - req.num_tokens)
            if limit < 1:
                continue
            if req.draft is None:
                req.draft = copy.copy(self.draft)
                req.draft.bind(self.model, req.prompt)
            guess = list(req.draft.propose(req.tokens, limit))[:limit]
            check_guess(guess, cfg.vocab_size)
            if guess:
                need = self.pool.pages_needed(req.seq, len(guess))    # every group's, less what a window frees
                self.stats["lookahead_pages"] += sum(max(k, 0) for k in need.values())
                self.pool.reserve([(req.seq, len(guess))])    # a window is judged from the decode
                req.guess, scheduled[req], budget = guess, 1 + len(guess), budget - len(guess)
        return budget

    def next_to_admit(self) -> Request:
        """The waiting request admission tries next (a policy overrides this; the engine never skips
        the one chosen): the head of the queue, or with schedule="lpm" and no preempted request at
        the head, the one with the longest cached prefix, the earliest first."""
        head = self.waiting[0]
        if self.schedule == "fcfs" or head.events["preempted"]:
            return head
        return max(self.waiting, key=self.cached_prefix)        # the first of equal maxima: the earliest

    def cached_prefix(self, req) -> int:
        """Positions of `req` its admission would take from the cache now (changes nothing)."""
        return self.manager.cached_prefix(self._index_keys(req, (req.num_tokens - 1) // self.page_size))

    def _admit(self, req, budget, now) -> int:
        """Give a waiting request its cached prefix and its first chunk; the chunk's tokens, or 0 (nothing
        changed) when the pool has no room for it."""
        P, seq = self.page_size, self.pool.new_id()
        # its cached prefix (none without an index); one token at least is computed: its logits are sampled
        taken = self.manager.lookup(seq, self._index_keys(req, (req.num_tokens - 1) // P))
        # headroom: a free page of every group for every running request (the next decodes would preempt
        # a request admitted without, wasting its first chunk); a chunk shrinks to fit a local group
        n = self.pool.fit(seq, min(req.num_tokens - taken * P, budget), spare=len(self.running))
        if n < 1:
            self.manager.release(seq)                 # the cached pages taken go back, still named
            return 0
        self.pool.reserve([(seq, n)])
        req.seq, req.computed, req.named, req.state = seq, taken * P, taken, "running"
        req.cached_tokens += taken * P
        req.events["admitted"].append(now)
        self.stats["cached_tokens"] += taken * P
        return n

    def _preempt(self, req, now):
        """Recompute later: the pages go back to the pool and the request waits at the head of the queue."""
        self._release(req)
        req.state = "waiting"
        req.events["preempted"].append(now)
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1

    def _release(self, req):
        self.running.remove(req)
        self._name_pages(req)                         # what it computed stays cached for later requests
        self.manager.release(req.seq)                 # named pages stay cached, free, least recent first
        req.seq, req.computed, req.named, req.guess, req.draft = None, 0, 0, [], None   # the draft's cache too

    def _run(self, batch, now) -> dict[int, list]:
        """The step's forward over every scheduled token; the new tokens of the sequences that completed:
        one greedy token, or with guesses those the verification accepted and one more."""
        w, cfg, device = self.weights, self.model.config, self.model.device
        step: StepBatch = self.pool.plan_step([(req.seq, n) for req, n in batch])   # reserved by _schedule
        feed = [req.tokens[req.computed:req.computed + n - len(req.guess)] + req.guess for req, n in batch]
        ends = list(itertools.accumulate(n for _, n in batch))        # one past each sequence's last token
        sample = [(req, end - 1 - len(req.guess)) for (req, n), end in zip(batch, ends, strict=True)
                  if req.computed + n - len(req.guess) == req.num_tokens]   # its last known token is in this step
        rows = [i for req, last in sample for i in range(last, last + 1 + len(req.guess))]  # and each guess's
        ids = torch.tensor([[t for f in feed for t in f]], device=device)
        if self.fast and self.fast.takes(step):       # a few decodes only: the whole step in one call (fast.py)
            logits = self.fast(ids, step, self.owner)
        else:
            logits = forward_cached(ids, w, cfg, step, positions=step.positions, state=self.owner,  # (just checked)
                                    logits_at=torch.tensor(rows, dtype=torch.long, device=device))
        greedy = logits[0].max(-1).indices.tolist()  # [rows] greedy (the first of equal maxima, as argmax)
        self.stats["computed_tokens"] += ends[-1]
        new, at = {}, 0
        for req, n in batch:
            if not (req.output and req.num_tokens - req.computed == 1):  # not a decode: a prefill chunk
                req.events["chunks"].append((now, n))
            if req.computed + n - len(req.guess) < req.num_tokens:    # a chunk that ends inside the prompt
                req.computed += n
                self._name_pages(req)
                continue
            # region engine_verify
            g, guess = greedy[at:at + 1 + len(req.guess)], req.guess  # g_i: the greedy token after guess i
            if req.temperature:                                       # sampled (a sampled request has no
                g = [self._token(req, logits[0, at])]                 # guesses)
            row, at = logits[0, at], at + len(g)
            a = common_prefix(guess, g)                               # the guesses greedy agrees
            out = guess[:a] + g[a:a + 1]                              # with, and one more
            req.computed += n - len(guess) + a                        # their keys and values are right
            if guess:                                                 # the rejected ones' are not: take
                freed = sum(map(len, self.manager.crop(req.seq, req.computed).values()))   # their pages back
                self.stats["rollback_pages"] += freed
                self.stats["proposed"] += len(guess)
                self.stats["accepted"] += a
                req.events["verify"].append((now, len(guess), a, freed))
                req.guess = []
            # endregion
            forked = [(branch, [self._fork(req, branch, row, now)]) for branch in req.branches]
            req.branches = []
            for r, tokens in [(req, out), *forked]:
                self._emit(r, tokens, now, new)
        return new

    def _token(self, req, row) -> int:
        """The next token from logits `row` [V]: the greedy one (the first of equal maxima), or one drawn from
        softmax(row / temperature) with the request's own generator."""
        if not req.temperature:
            return int(row.argmax())
        probs = torch.softmax(row.float() / req.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=req.generator))

    def _fork(self, req, branch, row, now) -> int:
        """`branch` takes every page of `req`, which has just computed its prompt (shared, counted:
        the partly filled last page is copied on first write), and runs from here on alone; its
        first token, drawn from the logits `row` [V] of the prompt's last position."""
        branch.seq = self.pool.fork(req.seq)
        branch.computed, branch.named, branch.keys = req.computed, req.named, list(req.keys)
        branch.state, branch.parent = "running", None
        branch.events["admitted"].append(now)
        self.running.append(branch)
        return self._token(branch, row)

    def _emit(self, req, out, now, new):
        """Append the step's tokens `out` to `req` (up to its eos), and release it if it finished."""
        if req.eos_id in out:
            out = out[:out.index(req.eos_id) + 1]
        req.output += out
        self._name_pages(req)                       # pages full of accepted tokens only
        new[req.id] = out
        if req.events["first_token"] is None:
            req.events["first_token"] = now
        if len(req.output) >= req.max_new_tokens or req.eos_id in out:
            self._release(req)
            req.state, req.events["finished"] = "finished", now

    def _name_pages(self, req):
        """Publish the pages of `req` that became full in the prefix index (chapter 6's names, or chapter 11's
        tree), so later requests starting alike take them."""
        full = req.computed // self.page_size
        if full != req.named:
            self.manager.publish(req.seq, self._index_keys(req, full), start=req.named)
            req.named = full

    def _index_keys(self, req, count) -> list:
        """The prefix index's keys of the first `count` full pages of `req`, its chain extended as needed."""
        keys = self.manager.keys(req.tokens[:count * self.page_size], known=req.keys)
        if len(keys) > len(req.keys):
            req.keys = keys
        return keys

    def __repr__(self):
        free = ", ".join(f"{self.manager.num_free[g]}/{self.manager.num_pages[g]} {g}" for g in self.manager.groups)
        return (f"ServingEngine({len(self.running)} running, {len(self.waiting)} waiting, "
                f"{free} pages free, page_size={self.page_size}, max_batch_tokens={self.max_batch_tokens}, "
                f"prefix_caching={self.manager.index or False}, schedule={self.schedule})")


@torch.inference_mode()
def drive(engine, prompts, max_new_tokens, arrivals=None, eos_id=None, *, in_seconds=False, on_step=None,
          max_steps=None, until=None, n=1, temperature=0.0, seed=None) -> list[int]:
    """Serve `prompts` (id lists) through `engine` until they finish; returns the requests' ids, in prompt order.
    `max_new_tokens`: an int, or one per prompt. Prompt i is added before the first step at which arrivals[i] is
    due: a step number counted from this call (default 0), or with in_seconds=True, seconds after the call began.
    After each step, on_step(engine, step()'s {id: tokens}). RuntimeError after max_steps steps. until(engine):
    stop after the first step at which it is true. n, temperature, seed: as add_request's (seed + n * i for prompt
    i); the answers of prompt i are the requests rids[i] .. rids[i] + n - 1."""
    count = len(prompts)
    news, arrivals = per_prompt(count, max_new_tokens, arrivals, in_seconds)
    checked = [engine._check(p, m, eos_id, n, temperature, None if seed is None else seed + n * i)
               for i, (p, m) in enumerate(zip(prompts, news, strict=True))]
    order = sorted(range(count), key=lambda i: arrivals[i])
    t0, first, rids, k = time.perf_counter(), engine.stats["steps"], [None] * count, 0
    now = (lambda: time.perf_counter() - t0) if in_seconds else (lambda: engine.stats["steps"] - first)
    while k < count or not all(engine.requests[r + j].done for r in rids for j in range(n)):
        while k < count and arrivals[order[k]] <= now():
            rids[order[k]] = engine._add(checked[order[k]])
            k += 1
        if in_seconds and not engine.running and not engine.waiting:      # idle until the next arrival
            time.sleep(max(0.0, arrivals[order[k]] - now()))
            continue
        if max_steps is not None and engine.stats["steps"] - first >= max_steps:
            raise RuntimeError(f"the requests did not finish in {max_steps} steps: {engine!r}")
        new = engine.step()
        if on_step is not None:
            on_step(engine, new)
        if engine.waiting and not engine.running and not engine.stats["batch_sizes"][-1]:   # a bug, never a wait
            raise RuntimeError(f"the scheduler admitted nothing into an idle engine: {engine!r}")
        if until is not None and until(engine):
            break
    return rids


def per_prompt(n: int, max_new_tokens, arrivals=None, in_seconds=False) -> tuple[list, list]:
    """(max_new_tokens, arrivals), one of each per prompt of n: an int or a list of max_new_tokens; arrivals
    step numbers (ints), or seconds with in_seconds, 0 for all by default. InputError if they do not fit."""
    news = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * n
    arrivals = [0] * n if arrivals is None else list(arrivals)
    if len(news) != n or len(arrivals) != n:
        raise InputError(f"{n} prompts but {len(news)} max_new_tokens and {len(arrivals)} arrivals")
    for a in arrivals:
        if isinstance(a, bool) or not isinstance(a, (float, int) if in_seconds else int) or not a >= 0:
            raise InputError(f"an arrival is {'a time in seconds' if in_seconds else 'a step number, an int'} "
                             f"of at least 0, got {a!r}")
    return news, arrivals
