"""Prefill apart from decode (chapter 11, section 6): a `PrefillEngine` hands each request over at its first token
as a `PageSet` (its pages as bytes, with all a receiver checks); a `DecodeEngine` takes it (`add_prefilled`) and
decodes it as any request. lab/serve/disagg.py runs the two in two processes. Local layers are not handed off.
"""

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass

import torch

from ..cache import CacheInputError, CacheMismatchError, CacheStateError, OutOfPagesError
from ..models import InputError
from .generate import check_counts
from .hashing import page_keys
from .identity import StateIdentity, identity_of, token_ids
from .serving import ServingEngine, drive, per_prompt
from .tiers import raw

MAGIC = b"lab.PageSet/1\n"          # the first bytes of a serialised PageSet, with the format's version
clock = time.monotonic               # CLOCK_MONOTONIC on Linux: one clock for every process of the machine


class HandoffError(CacheMismatchError):
    """A PageSet a decode engine refuses: another model, dtype, page size or layout, or damaged bytes.
    `fields` names what differs ("page_size", "identity.manifest", "sha256", ...). Nothing was changed."""

    def __init__(self, message: str, fields=()):
        super().__init__(message)
        self.fields = tuple(fields)


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")                 # torch.bfloat16 -> "bfloat16"


@dataclass(eq=True, repr=False)
class PageSet:
    """One request's prompt KV, from a prefill worker to a decode worker, with what it was computed by."""

    identity: StateIdentity   # chapter 4: weights (manifest), tokenizer, dtypes, positions, salt
    model: str                # the config's name and architecture, to say what differs in words
    arch: str
    dtype: str                # the pool's dtype, "float32"
    page_size: int            # positions per page
    layout: tuple             # (cache layers, kv heads, head dim): config.kv_layout
    prompt: list              # the prompt's token ids, T of them
    first_token: int          # the greedy token the prefill sampled after the prompt
    names: list               # (digest, parent, tokens) of each full page: T // page_size of them
    k: bytes                  # keys, [pages, layers, page_size, H_kv, D] in `dtype`; pages = ceil(T / page_size)
    v: bytes                  # values, the same shape; the last page's positions past T are zeros
    sha256: str = ""          # over the header and both payloads: `digest()`

    @property
    def num_pages(self) -> int:
        return -(-len(self.prompt) // self.page_size)

    @property
    def shape(self) -> tuple:                                  # [pages, layers, page_size, H_kv, D]
        return (self.num_pages, self.layout[0], self.page_size, *self.layout[1:])

    def tensors(self) -> tuple:
        """The keys and values as tensors, each `[pages, layers, page_size, H_kv, D]`."""
        dtype = getattr(torch, self.dtype)
        return tuple(torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).view(self.shape)
                     for b in (self.k, self.v))

    def _header(self, sealed=True) -> bytes:
        h = dict(identity=asdict(self.identity), model=self.model, arch=self.arch, dtype=self.dtype,
                 page_size=self.page_size, layout=list(self.layout), prompt=list(self.prompt),
                 first_token=self.first_token, names=[[d.hex(), p.hex(), list(t)] for d, p, t in self.names],
                 k_bytes=len(self.k), v_bytes=len(self.v))
        if sealed:
            h["sha256"] = self.sha256
        return json.dumps(h, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> str:
        """sha256 over the header (everything but the sha256 itself) and the bytes of the keys and values."""
        h = hashlib.sha256(self._header(sealed=False))
        h.update(self.k)
        h.update(self.v)
        return h.hexdigest()

    def to_bytes(self) -> bytes:
        """MAGIC, the header's length (8 bytes, little-endian), the header (JSON), the keys, the values."""
        header = self._header()
        return b"".join((MAGIC, len(header).to_bytes(8, "little"), header, self.k, self.v))

    def nbytes(self) -> int:
        """Bytes moved: the length of `to_bytes()`."""
        return len(MAGIC) + 8 + len(self._header()) + len(self.k) + len(self.v)

    @classmethod
    def from_bytes(cls, data) -> "PageSet":
        """The PageSet `to_bytes` wrote; HandoffError ("format") for anything else. Not yet checked: a decode
        engine checks it (`DecodeEngine.check`) before it takes it."""
        data = memoryview(data)
        try:
            if bytes(data[:len(MAGIC)]) != MAGIC:
                raise ValueError(f"it does not start with {MAGIC!r}")
            at = len(MAGIC) + 8
            size = int.from_bytes(data[len(MAGIC):at], "little")
            h = json.loads(bytes(data[at:at + size]))
            at += size
            if at + h["k_bytes"] + h["v_bytes"] != len(data):
                raise ValueError(f"the header promises {at + h['k_bytes'] + h['v_bytes']} bytes, there are {len(data)}")
            return cls(StateIdentity(**h["identity"]), h["model"], h["arch"], h["dtype"], h["page_size"],
                       tuple(h["layout"]), h["prompt"], h["first_token"],
                       [(bytes.fromhex(d), bytes.fromhex(p), list(t)) for d, p, t in h["names"]],
                       bytes(data[at:at + h["k_bytes"]]), bytes(data[at + h["k_bytes"]:]), h["sha256"])
        except (ValueError, KeyError, TypeError) as e:               # JSON and UTF-8 errors are ValueErrors
            raise HandoffError(f"not a readable PageSet: {e}", ["format"]) from e

    def __repr__(self):
        return (f"PageSet({self.model}, {len(self.prompt)} prompt tokens, {self.num_pages} pages of "
                f"{self.page_size}, {self.dtype}, {self.nbytes():,} bytes)")


def pageable(engine):
    """Hand-offs move the pages of a pool of one group named by chapter 6's chain: not a model with local
    layers (a group of pages each), nor a radix tree (`prefix_caching="radix"`)."""
    if len(engine.manager.groups) > 1:
        raise CacheInputError(f"{engine.model.config.name} has local layers (a pool per group of layers); "
                              "this hand-off moves the pages of a pool of one group only")
    if engine.manager.index == "radix":
        raise CacheInputError('a hand-off names its pages by the hash chain: prefix_caching is True or False, '
                              'not "radix"')


# ---- the prefill side ----
class PrefillEngine(ServingEngine):
    """A ServingEngine that stops every request at its first token: `step()` returns {request id:
    PageSet} for each, and those requests leave the engine (their full pages stay named)."""

    def __init__(self, model, num_pages: int, page_size: int = 16, max_batch_tokens: int = 256,
                 prefix_caching: bool = True):
        super().__init__(model, num_pages, page_size, max_batch_tokens, prefix_caching=prefix_caching)
        pageable(self)

    def add_request(self, ids, max_new_tokens: int = 2, eos_id=None) -> int:
        """Queue a prompt to prefill (for its first token: max_new_tokens and eos_id are not used); its id."""
        return super().add_request(ids, 2)

    def _check(self, ids, max_new_tokens, eos_id, *_):
        """Every request is queued for 2 new tokens, whatever was asked, one answer: after its first, it still
        runs and holds its pages until `step` exports them (a request that finished would have given them back)."""
        return super()._check(ids, 2, None)

    @torch.inference_mode()
    def step(self) -> dict:
        handed = {}
        for rid in super().step():           # in this engine every token is a first token
            req = self.requests[rid]
            handed[rid] = self.export(req)
            self._release(req)
            req.state, req.events["finished"] = "finished", self.stats["steps"] - 1
        return handed

    def export(self, req) -> PageSet:
        """The PageSet of a running request whose prompt is computed and whose first token is sampled."""
        T, P = len(req.prompt), self.page_size
        if req.computed != T or len(req.output) != 1 or self.manager.length(req.seq) != T:
            raise CacheStateError(f"request {req.id}: {req.computed} of {T} prompt positions computed and "
                                  f"{len(req.output)} tokens sampled; a PageSet is taken after the first token")
        table = self.manager.block_table(req.seq)                    # ceil(T / P) pages
        k, v = (torch.stack(t) for t in zip(*(self.pool.page(p) for p in table), strict=True))
        for t in (k, v):                                             # [pages, layers, P, H_kv, D]
            t[-1, :, T - (len(table) - 1) * P:] = 0                  # past the prompt: zeros, not a stale page
        identity = identity_of(self.model, self.pool)
        ps = PageSet(identity, self.model.config.name, self.model.config.arch, dtype_name(self.pool.dtype), P,
                     tuple(self.model.config.kv_layout), list(req.prompt), req.output[0],
                     page_keys(req.prompt, P, (identity,)), raw(k), raw(v))
        ps.sha256 = ps.digest()
        return ps


def prefill(engine, ids, page_size: int = 16) -> PageSet:
    """The PageSet of one prompt. `engine`: an idle PrefillEngine (its cached pages are reused), or a Model,
    for which a PrefillEngine just big enough for `ids` is built (pages of `page_size`)."""
    if not isinstance(engine, PrefillEngine):
        pages = -(-(len(token_ids(ids)) + 1) // page_size)           # the prompt and the one token past it
        engine = PrefillEngine(engine, pages, page_size, max_batch_tokens=min(256, engine.config.max_positions))
    if engine.running or engine.waiting:
        raise CacheStateError("prefill() runs one prompt through an idle engine; with others in flight, "
                              "call add_request and step yourself")
    handed = {}
    rid, = drive(engine, [ids], 2, on_step=lambda e, new: handed.update(new))
    return handed[rid]


# ---- the decode side ----
class DecodeEngine(ServingEngine):
    """A ServingEngine that also takes requests prefilled elsewhere (`add_prefilled`), ordinary requests from then
    on. stats adds handoffs (PageSets taken) and handoff_bytes (their `nbytes()`)."""

    def __init__(self, model, num_pages: int, page_size: int = 16, max_batch_tokens: int = 256,
                 prefix_caching: bool = True, draft=None, k: int = 4):
        super().__init__(model, num_pages, page_size, max_batch_tokens, prefix_caching, draft, k)
        pageable(self)
        self.stats |= dict(handoffs=0, handoff_bytes=0)

    # region handoff_check
    def check(self, ps: PageSet):
        """Raise HandoffError naming every way `ps` differs from what this engine's pool holds,
        or, if it matches, a sha256 that does not match its contents; nothing else is read from
        it before."""
        if not isinstance(ps, PageSet):
            raise TypeError(f"add_prefilled takes a PageSet, got {type(ps).__name__}")
        cfg, mine = self.model.config, identity_of(self.model, self.pool)
        pairs = [("model", ps.model, cfg.name), ("arch", ps.arch, cfg.arch),
                 ("dtype", ps.dtype, dtype_name(self.pool.dtype)),
                 ("page_size", ps.page_size, self.page_size),
                 ("layout", tuple(ps.layout), tuple(cfg.kv_layout))]
        pairs += [(f"identity.{f.name}", getattr(ps.identity, f.name), getattr(mine, f.name))
                  for f in dataclasses.fields(StateIdentity)]
        differ = [(name, theirs, ours) for name, theirs, ours in pairs if theirs != ours]
        if differ:
            said = "; ".join(f"{name} {short(theirs)}, this engine's {short(ours)}"
                             for name, theirs, ours in differ)
            raise HandoffError(f"page set refused, it was computed for another state: {said}",
                               [name for name, _, _ in differ])
        if ps.digest() != ps.sha256:
            raise HandoffError(f"page set refused: its sha256 {short(ps.sha256)} does not match its "
                               f"contents {short(ps.digest())} (damaged on the way)", ["sha256"])
    # endregion

    def add_prefilled(self, ps: PageSet, max_new_tokens: int, eos_id: int | None = None) -> int:
        """Take a request prefilled elsewhere: check `ps` (HandoffError), reserve its pages (OutOfPagesError unless
        they and a free page per running request are free now), write its bytes (full pages this pool has cached
        already are taken instead), name its full pages, and put it into `running` with its first token. Returns
        its id. A refusal of any kind leaves the engine as it was."""
        self.check(ps)
        req, = self._check(ps.prompt, max_new_tokens, eos_id)       # as add_request: positions, pages, eos
        P, now = self.page_size, self.stats["steps"]
        if type(ps.first_token) is not int or not 0 <= ps.first_token < self.model.config.vocab_size:
            raise HandoffError(f"page set refused: first token {ps.first_token!r} is not a token id", ["first_token"])
        if ps.names != page_keys(req.prompt, P, (ps.identity,)):
            raise HandoffError("page set refused: its page names are not its prompt's", ["names"])
        size = math.prod(ps.shape) * self.pool.dtype.itemsize
        if len(ps.k) != size or len(ps.v) != size:
            raise HandoffError(f"page set refused: {len(ps.k)} and {len(ps.v)} bytes of keys and values, "
                               f"{size} expected for {ps.shape}", ["k", "v"])
        req.output = [ps.first_token]
        if len(req.output) < max_new_tokens and ps.first_token != eos_id:
            self._take_pages(req, ps)                                 # OutOfPagesError: nothing changed
        rid = self._add([req])
        self.waiting.remove(req)
        ev = req.events
        ev["handed_off"] = ev["first_token"] = now
        if req.seq is None:                                            # done at its first token
            req.state, ev["finished"] = "finished", now
        else:
            req.state = "running"
            ev["admitted"].append(now)
            self.running.append(req)
        self.stats["handoffs"] += 1
        self.stats["handoff_bytes"] += ps.nbytes()
        return rid

    def _take_pages(self, req, ps):
        """Reserve the prompt's T positions for `req`, its cached full pages taken, the rest written from `ps`."""
        T, P = len(req.prompt), self.page_size
        seq = self.pool.new_id()
        taken = self.manager.lookup(seq, ps.names if self.prefix_caching else [])
        if self.pool.room(seq, spare=len(self.running)) < T:
            self.manager.release(seq)                                 # the cached pages taken go back, named
            raise OutOfPagesError(f"a page set of {ps.num_pages} pages: {self.manager.num_free['full']} pages "
                                  f"free, {len(self.running)} kept for the running requests")
        self.pool.reserve([(seq, T - taken * P)])
        k, v = ps.tensors()                                           # [pages, layers, P, H_kv, D]
        for i, page in enumerate(self.manager.block_table(seq)[taken:], start=taken):
            self.pool.set_page(page, (k[i], v[i]))                    # [layers, P, H_kv, D] each
        if self.prefix_caching:
            self.manager.publish(seq, ps.names, start=taken)
        req.seq, req.computed, req.keys = seq, T, list(ps.names)
        req.named = len(ps.names) if self.prefix_caching else 0
        req.cached_tokens += taken * P
        self.stats["cached_tokens"] += taken * P


def short(x) -> str:
    """A value for an error message: long hashes cut to 12 characters."""
    return repr(x[:12] + "...") if isinstance(x, str) and len(x) > 16 else repr(x)


# ---- two processes ----
class WorkerError(RuntimeError):
    """A worker process failed (its traceback is in the message), ended, or went silent past the timeout."""


def warm_up(model, page_size: int = 16):
    """One short request through a throwaway engine: the first calls' one-time costs are not measured."""
    ServingEngine(model, 4, page_size, max_batch_tokens=16, prefix_caching=False).generate([[1, 2, 3]], 3)


def checked(prompts, max_new_tokens, arrivals_s) -> tuple:
    """(prompts as lists of ids, max_new_tokens per prompt, arrival seconds per prompt), checked."""
    prompts = [token_ids(p).tolist() for p in prompts]
    news, arrivals = per_prompt(len(prompts), max_new_tokens, arrivals_s, in_seconds=True)
    for m in news:
        check_counts(InputError, max_new_tokens=m)
    return prompts, news, [float(a) for a in arrivals]


def entry(i, prompt, tokens, arrival, times, nbytes, t0) -> dict:
    """One request's timeline, in seconds since t0: arrival_s, first_token_s, token_s (one time per token,
    the first token's first), ttft_s, and bytes_moved (its PageSet's, 0 on one engine)."""
    token_s = [t - t0 for t in times]
    return dict(id=i, prompt_tokens=len(prompt), output_tokens=len(tokens), arrival_s=arrival - t0,
                first_token_s=token_s[0], token_s=token_s, ttft_s=token_s[0] - (arrival - t0), bytes_moved=nbytes)


__all__ = ["PageSet", "HandoffError", "PrefillEngine", "DecodeEngine", "prefill", "WorkerError"]
