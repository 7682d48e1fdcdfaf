"""Chapter 9, "Speculation and rollback": drafts that guess, a target that verifies k guesses in one forward,
and caches that take back what was rejected. SmolLM2, float32, greedy, on two workloads built from the
held-out plays:

- heldout: a passage, continued (what the model writes next is new text);
- copy: a chat turn asking the model to repeat a passage word for word (an editing task: the answer
  repeats the prompt, where prompt lookup shines).

Measured: acceptance and tokens per target forward against k for each draft (prompt lookup, the model over a
small cache, its first layers); SelfDraft's acceptance against its cache's budget and bits; decode tokens per
second against plain decoding at contexts of 256 to 4,096 (plain decoding is the same loop with a draft
that never guesses, `NoDraft`); the cost of a rollback per cache design; the serving engine with and without
speculation at 1 and 16 requests in flight, and its prefix hits with and without; transformers' assisted
generation (`prompt_lookup_num_tokens`) and vLLM's ngram method on the same prompts. Every speculative run's
tokens are compared with plain greedy decoding's.
"""

import time

import matplotlib.ticker
import numpy as np
import torch
from tqdm.auto import tqdm

from .. import data
from ..cache import EvictingCache, QuantizedCache, make_cache
from ..engine import EarlyExit, PromptLookup, SelfDraft, ServingEngine, speculative_generate
from ..engine.serving import drive
from ..engine.speculative import NoDraft
from ..metrics import ratio_interval
from ..models import forward_cached, load
from ..models.load import smollm2_folder
from ..peers import compare_vllm
from ..results import figures_dir, not_run, provenance, quick, value, write_section
from . import plots
from .plots import finish

SECTION = "ch09"
PAGE = 16


def settings(quick_mode: bool) -> dict:
    if quick_mode:
        return dict(passages=2, prompt=200, new=12, ks=(4, 8), drafts=("lookup", "window", "kivi2", "early20"),
                    budget_prompt=192, budget_passages=1, budgets=(64, 128), bits=(2,), contexts=(256, 1024),
                    context_new=8, reps=1, rollback_context=256, rollback_reps=3, engine_levels=(1, 4),
                    engine_prompt=96, engine_new=16, turns=2, hf=True, vllm=False, speed_drafts=("lookup", "window"))
    return dict(passages=8, prompt=200, new=48, ks=(1, 2, 4, 8), drafts=("lookup", "window", "kivi2", "early20"),
                budget_prompt=768, budget_passages=4, budgets=(64, 128, 256, 512), bits=(2, 4),
                contexts=(256, 512, 1024, 2048, 4096), context_new=32, reps=2, rollback_context=1024,
                rollback_reps=30, engine_levels=(1, 16), engine_prompt=160, engine_new=48, turns=3, hf=True,
                vllm=compare_vllm.available(), speed_drafts=("lookup", "window", "kivi2", "early20"))


# ---- prompts and drafts -----------------------------------------------------------------------------------

def prompts(model, n_tokens: int, count: int, seed: int = 0) -> dict:
    """{"heldout": passages to continue, "copy": requests to repeat a passage}: `count` of each."""
    tok = model.tokenizer
    passages = data.passages(tok, n_tokens, count=2 * count, seed=seed)
    return {"heldout": passages[:count], "copy": [data.repeat_request(tok, p) for p in passages[count:]]}


def long_copy(model, context: int, seed: int = 0) -> list:
    """`context` tokens that end where a passage starts over: a held-out passage, a blank line, and the
    passage's first words, so the continuation repeats it (as a reply quoting a document does)."""
    tok = model.tokenizer
    head = 16
    passage = data.passages(tok, context - head - 2, count=1, seed=seed)[0]
    ids = passage + tok.encode("\n\n") + passage[:head]
    return ids[-context:]


def make_draft(model, name: str, budget: int | None = None):
    """A draft by name: "lookup" (n = 3), "window" (SelfDraft over 4 sinks plus a window, `budget` positions,
    64 by default), "kivi2"/"kivi4" (SelfDraft over a KIVI cache of those bits), "earlyL" (the first L
    layers)."""
    cfg = model.config
    if name == "lookup":
        return PromptLookup(3)
    if name == "window":
        return SelfDraft(lambda: EvictingCache(cfg, budget or 64, "sinks"))
    if name.startswith("kivi"):
        return SelfDraft(lambda: QuantizedCache(cfg, bits=int(name[4:]), scheme="kivi"))
    if name.startswith("early"):
        return EarlyExit(int(name[5:]))
    raise ValueError(f"unknown draft {name!r}")


def plain_tokens(model, ids, n) -> list:
    return speculative_generate(model, ids, n, NoDraft()).tokens


# ---- the verify chunk ------------------------------------------------------------------------------------

@torch.inference_mode()
def chunk_cost(model, context: int = 256, sizes=(1, 2, 5, 9), reps: int = 5) -> dict:
    """{n: median seconds} of one forward of n tokens through a StaticCache holding `context` positions: a
    decode step (n = 1) and verify chunks of k = n - 1 guesses. The sizes run in turn, `reps` rounds."""
    ids = torch.tensor([data.passages(model.tokenizer, context + max(sizes), count=1, seed=6)[0]])
    times = {n: [] for n in sizes}
    for _ in tqdm(range(reps + 1), desc="verify chunks: rounds"):   # the first round warms up, untimed
        for n in sizes:
            cache = make_cache("static", model.config, context + n)
            forward_cached(ids[:, :context], model.weights, model.config, cache, last_only=True)
            t0 = time.perf_counter()
            forward_cached(ids[:, context:context + n], model.weights, model.config, cache)
            times[n].append(time.perf_counter() - t0)
    return {n: float(np.median(t[1:])) for n, t in times.items()}


# ---- acceptance -------------------------------------------------------------------------------------------

def acceptance(model, s) -> dict:
    """{workload: {draft: {k: summed proposed, accepted, steps, tokens, identical, and `passages`: each prompt's
    (proposed, accepted)}}} over the prompts, for an interval over passages."""
    work, out = prompts(model, s["prompt"], s["passages"]), {}
    runs = [(w, d, k) for w in work for d in s["drafts"] for k in s["ks"]]
    want = {(w, i): plain_tokens(model, p, s["new"]) for w, ps in work.items() for i, p in enumerate(ps)}
    for w, d, k in tqdm(runs, desc="acceptance"):
        tot = dict(proposed=0, accepted=0, steps=0, tokens=0, identical=True, passages=[])
        for i, p in enumerate(work[w]):
            r = speculative_generate(model, p, s["new"], make_draft(model, d), k=k)
            tot["passages"].append((r.proposed, r.accepted))
            tot["proposed"] += r.proposed
            tot["accepted"] += r.accepted
            tot["steps"] += r.steps - 1
            tot["tokens"] += len(r.tokens) - 1
            tot["identical"] &= r.tokens == want[w, i]
        out.setdefault(w, {}).setdefault(d, {})[k] = tot
    return dict(runs=out, prompt_tokens={w: [len(p) for p in ps] for w, ps in work.items()})


def budgets(model, s) -> dict:
    """SelfDraft's acceptance at k = 4 on held-out text of `budget_prompt` tokens, against the window's
    budget (to the full cache) and KIVI's bits."""
    ps = data.passages(model.tokenizer, s["budget_prompt"], count=s["budget_passages"], seed=1)
    full = lambda: make_cache("static", model.config, s["budget_prompt"] + s["new"] + 8)  # noqa: E731
    cases = {f"window_{b}": make_draft(model, "window", b) for b in s["budgets"]}
    cases |= {f"kivi{b}": make_draft(model, f"kivi{b}") for b in s["bits"]} | {"full": SelfDraft(full)}
    out = {}
    for name, draft in tqdm(cases.items(), desc="draft budgets"):
        rs = [speculative_generate(model, p, s["new"], draft, k=4) for p in ps]
        out[name] = dict(proposed=sum(r.proposed for r in rs), accepted=sum(r.accepted for r in rs),
                         steps=sum(r.steps - 1 for r in rs), tokens=sum(len(r.tokens) - 1 for r in rs),
                         passages=[(r.proposed, r.accepted) for r in rs])
    return out


class SourcedLookup(PromptLookup):
    """PromptLookup that notes, for every proposal, the context's length and whether the n-gram it matched lies
    in the prompt or in the model's own output so far."""

    def bind(self, model, prompt):
        self.prompt_len, self.proposals = len(prompt), []

    def propose(self, context: list, k: int) -> list:
        n, tail = self.n, context[-self.n:]
        for i in range(len(context) - n - 1, -1, -1):           # as PromptLookup: the latest match first
            if context[i:i + n] == tail:
                guess = context[i + n:i + n + k]
                self.proposals.append((len(context), guess, i + n >= self.prompt_len))
                return guess
        return []


def lookup_sources(model, s, k: int = 4) -> dict:
    """Where prompt lookup's guesses come from, per workload: {workload: {"prompt" | "output": proposed,
    accepted}}. A guess copied from the model's own output repeats what it already wrote. Accepted guesses are
    counted against the tokens the run emitted, which are plain greedy decoding's: a proposal at context length
    c keeps the longest run of its guesses that equals the tokens from c on."""
    out = {}
    for w, ps in tqdm(prompts(model, s["prompt"], s["passages"]).items(), desc="lookup sources: workloads"):
        tally = {src: dict(proposed=0, accepted=0) for src in ("prompt", "output")}
        for p in ps:
            draft = SourcedLookup(3)
            r = speculative_generate(model, p, s["new"], draft, k=k)
            ids, accepted = p + r.tokens, 0
            for c, guess, from_output in draft.proposals:
                kept = next((i for i, g in enumerate(guess) if g != ids[c + i]), len(guess))
                t = tally["output" if from_output else "prompt"]
                t["proposed"], t["accepted"] = t["proposed"] + len(guess), t["accepted"] + kept
                accepted += kept
            assert accepted == r.accepted, f"{accepted} guesses kept by the count, {r.accepted} by the run"
        out[w] = tally
    return out


# ---- speed ------------------------------------------------------------------------------------------------

def speed(model, s) -> dict:
    """Decode tokens per second (after the prefill) of plain decoding and of each of `speed_drafts` (k = 4) at
    each context, on a passage that starts over (long_copy). They run in turn, `reps` times; medians."""
    out = {}
    cases = {"plain": NoDraft} | {d: (lambda d=d: make_draft(model, d)) for d in s["speed_drafts"]}
    for ctx in tqdm(s["contexts"], desc="speed: contexts"):
        ids, times, res = long_copy(model, ctx), {c: [] for c in cases}, {}
        speculative_generate(model, ids[:64], 4, PromptLookup(3))                      # warm-up
        for _ in range(s["reps"]):
            for c, draft in cases.items():
                r = speculative_generate(model, ids, s["context_new"], draft(), k=4)
                times[c].append(r.decode_seconds)
                res[c] = r
        out[ctx] = {c: dict(tok_s=(s["context_new"] - 1) / float(np.median(t)), seconds=float(np.median(t)),
                            acceptance=res[c].acceptance, per_step=res[c].tokens_per_step,
                            identical=res[c].tokens == res["plain"].tokens) for c, t in times.items()}
    return out


def attention_share(model, context: int) -> float:
    """The share of a decode step's bytes that are the cache's at `context` positions: K and V of every
    layer against the weights (float32); the bound a smaller draft cache can save per draft token."""
    cfg = model.config
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4 * context
    weights = sum(t.numel() * t.element_size() for t in model.weights.values())
    return kv / (kv + weights)


# ---- rollback ---------------------------------------------------------------------------------------------

ROLLBACK_DESIGNS = ("static", "concat", "paged", "int8", "kivi2")


def rollback(model, s) -> dict:
    """Per design, after a prefill of `rollback_context` - 4 tokens: a verify chunk of 9 tokens (k = 8), which
    crosses a page boundary, then the crop that takes 8 of them back (a rejection at the first guess); the
    crop's time (median of reps), one decode step's, and pages freed, then reserved again by the next step, for
    a paged cache of 16-position pages."""
    cfg, n = model.config, s["rollback_context"] - 4
    ids = torch.tensor([data.passages(model.tokenizer, n + 9, count=1, seed=2)[0]])
    make = {"int8": lambda: QuantizedCache(cfg, bits=8), "kivi2": lambda: QuantizedCache(cfg, bits=2, scheme="kivi")}
    out = {}
    run = lambda x, c: forward_cached(x, model.weights, cfg, c, last_only=True)  # noqa: E731
    with torch.inference_mode():
        for d in tqdm(ROLLBACK_DESIGNS, desc="rollback"):
            cache = make[d]() if d in make else make_cache(d, cfg, n + 16)
            run(ids[:, :n], cache)
            crops, steps, freed, reserved = [], [], 0, 0
            for _ in range(s["rollback_reps"]):
                run(ids[:, n:n + 9], cache)                        # t and 8 guesses
                pages = len(cache.manager.block_table(cache.seqs[0])) if d == "paged" else 0
                t0 = time.perf_counter()
                cache.crop(n + 1)                                  # keep t: every guess rejected
                crops.append(time.perf_counter() - t0)
                if d == "paged":
                    freed = pages - len(cache.manager.block_table(cache.seqs[0]))
                t0 = time.perf_counter()
                run(ids[:, n + 1:n + 2], cache)                    # the next step: one token
                steps.append(time.perf_counter() - t0)
                if d == "paged":
                    reserved = len(cache.manager.block_table(cache.seqs[0])) - pages + freed
                cache.crop(n)
            out[d] = dict(crop_us=float(np.median(crops)) * 1e6, step_ms=float(np.median(steps)) * 1e3,
                          pages_freed=freed, pages_reserved=reserved)
    return out


# ---- the engine -------------------------------------------------------------------------------------------

def engine_runs(model, s) -> dict:
    """The serving engine with prompt lookup (k = 4) and without, on copy requests (chat turns asking for a
    passage repeated), `c` at once for each level: output tokens per second, tokens identical."""
    out = {}
    bar = tqdm(total=2 * len(s["engine_levels"]), desc="engine: requests at once, draft")
    for c in s["engine_levels"]:
        ps = prompts(model, s["engine_prompt"], c, seed=3)["copy"]
        need = sum(-(-(len(p) + s["engine_new"] + 4) // PAGE) for p in ps)
        res = {}
        for name, draft in (("plain", None), ("lookup", PromptLookup(3))):
            bar.set_postfix_str(f"{c}, {name}")
            eng = ServingEngine(model, need + c, PAGE, 512, prefix_caching=False, draft=draft, k=4)
            eng.generate([ps[0][:32]], 2)                                              # warm-up
            t0 = time.perf_counter()
            outs = eng.generate(ps, s["engine_new"])
            seconds = time.perf_counter() - t0
            st = eng.stats
            res[name] = dict(tok_s=c * s["engine_new"] / seconds, seconds=seconds, outputs=outs,
                             proposed=st["proposed"], accepted=st["accepted"], lookahead_pages=st["lookahead_pages"],
                             rollback_pages=st["rollback_pages"])
            bar.update()
        res["lookup"]["identical"] = res["lookup"].pop("outputs") == res["plain"].pop("outputs")
        out[c] = res
    bar.close()
    return out


def prefix_hits(model, s) -> dict:
    """A multi-turn chat workload through the engine with prefix caching, with and without speculation:
    each turn sends the conversation so far and a new request. Positions taken from named pages, per run."""
    tok, out = model.tokenizer, {}
    passages = data.passages(tok, 48, count=4, seed=4)
    for name, draft in tqdm((("plain", None), ("lookup", PromptLookup(3))), desc="multi-turn chats: draft"):
        eng = ServingEngine(model, 512, PAGE, 512, prefix_caching=True, draft=draft, k=4)
        chats = [[{"role": "user", "content": "Repeat exactly:\n" + tok.decode(p)}] for p in passages]
        for turn in range(s["turns"]):
            ids = [tok.encode(tok.apply_chat_template(c)) for c in chats]
            answers = eng.generate(ids, 24)
            chats = [c + [{"role": "assistant", "content": tok.decode(a)},
                          {"role": "user", "content": f"Again, part {turn + 2}."}] for c, a in zip(chats, answers,
                                                                                                   strict=True)]
        out[name] = dict(cached_tokens=eng.stats["cached_tokens"], computed_tokens=eng.stats["computed_tokens"],
                         accepted=eng.stats["accepted"], proposed=eng.stats["proposed"], answers=answers)
    out["equal"] = out["plain"]["cached_tokens"] == out["lookup"]["cached_tokens"]
    out["identical"] = out["plain"].pop("answers") == out["lookup"].pop("answers")
    return out


def verify_timeline(model, n: int = 3, k: int = 4) -> dict:
    """One verify step of one request in the engine (pages of 16), drawn from a real run: a copy request,
    PromptLookup(n) with k guesses; the first step whose guesses were partly rejected and gave pages back.
    `pages_held` counts the pages the sequence held during the step, the lookahead pages for its guesses
    included: the crop then gave back `pages_freed` of them."""
    tok = model.tokenizer
    p = data.repeat_request(tok, data.passages(tok, 120, count=1, seed=5)[0])
    eng = ServingEngine(model, 64, PAGE, 512, prefix_caching=True, draft=PromptLookup(n), k=k)
    found, start = {}, [0]                        # start: positions computed before the step

    def look(engine, new):
        req = next(iter(engine.requests.values()))
        v = req.events["verify"]
        if v and v[-1][0] == engine.stats["steps"] - 1 and 0 < v[-1][2] < v[-1][1] and v[-1][3] > 0:
            step, guesses, accepted, freed = v[-1]
            held = len(engine.manager.block_table(req.seq)) if req.seq is not None else 0
            found.update(step=step, start=start[0], guesses=guesses, accepted=accepted, pages_freed=freed,
                         pages_held=held + freed, page_size=PAGE, n=n, k=k)
        start[0] = req.computed

    drive(eng, [p], 96, on_step=look, until=lambda engine: bool(found))
    return found


# ---- peers ------------------------------------------------------------------------------------------------

def transformers_lookup(model, s) -> dict:
    """transformers' assisted generation with prompt_lookup_num_tokens = 4 (n-grams of up to 3, as ours) and
    its plain greedy generate, on the copy prompts: tokens against the lab's, seconds side by side."""
    from ..models.hf import to_transformers

    hf, out = to_transformers(model), {}
    ps = prompts(model, s["prompt"], s["passages"])["copy"]
    gen = dict(max_new_tokens=s["new"], min_new_tokens=s["new"], do_sample=False, pad_token_id=0, eos_token_id=None,
               disable_compile=True)
    rows = []
    with torch.inference_mode():
        for p in tqdm(ps, desc="transformers"):
            ids = torch.tensor([p])
            hf.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), **gen)  # warm-up
            row = {}
            for name, extra in (("plain", {}), ("lookup", dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3))):
                t0 = time.perf_counter()
                y = hf.generate(ids, attention_mask=torch.ones_like(ids), **gen, **extra)[0, len(p):].tolist()
                row[f"hf_{name}_s"], row[f"hf_{name}"] = time.perf_counter() - t0, y
            for name, draft in (("plain", NoDraft()), ("lookup", PromptLookup(3))):
                t0 = time.perf_counter()
                r = speculative_generate(model, p, s["new"], draft, k=4)
                row[f"lab_{name}_s"], row[f"lab_{name}"] = time.perf_counter() - t0, r.tokens
            rows.append(row)
    out = {f"{side}_{name}_s": sum(r[f"{side}_{name}_s"] for r in rows) for side in ("hf", "lab")
           for name in ("plain", "lookup")}
    out["same_tokens"] = all(r["hf_lookup"] == r["lab_lookup"] == r["hf_plain"] for r in rows)
    out["agreement"] = float(np.mean([np.mean([a == b for a, b in zip(r["hf_lookup"], r["lab_lookup"], strict=True)])
                                      for r in rows]))
    out["prompts"], out["new_tokens"] = len(rows), s["new"]
    return out


def vllm_ngram(model, s) -> dict:
    """vLLM's CPU build with its ngram method (k = 4, n-grams of 1 to 3) and without, on the copy prompts:
    acceptance, decode seconds, and tokens against the lab's prompt lookup. A throw-away first request
    carries vLLM's warm-up."""
    ps = prompts(model, s["prompt"], s["passages"])["copy"]
    ours = [speculative_generate(model, p, s["new"], PromptLookup(3), k=4) for p in ps]
    out = {}
    for k in (4, 0):
        r = compare_vllm.run_spec(smollm2_folder(), [ps[0][:32]] + ps, k, n=3, max_tokens=s["new"], cores="0-1")
        rows = r["results"][1:]
        total = lambda name: sum(x[name] for x in rows)  # noqa: B023, E731
        out[f"k{k}"] = dict(seconds=total("seconds"), draft_tokens=total("draft_tokens"), drafts=total("drafts"),
                            accepted_tokens=total("accepted_tokens"), vllm=r["vllm"],
                            tokens=[x["tokens"] for x in rows])
    same = [np.mean([a == b for a, b in zip(x, o.tokens, strict=True)]) for x, o in zip(out["k4"]["tokens"], ours,
                                                                                        strict=True)]
    for k in (4, 0):
        out[f"k{k}"].pop("tokens")
    out["agreement"], out["lab_proposed"] = float(np.mean(same)), sum(o.proposed for o in ours)
    out["lab_accepted"] = sum(o.accepted for o in ours)
    return out


# ---- measure and record -----------------------------------------------------------------------------------

def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    smol = load("smollm2")
    m = dict(settings=s, manifest=smol.manifest, threads=torch.get_num_threads())
    m["chunk"] = chunk_cost(smol)
    m["acceptance"] = acceptance(smol, s)
    m["budgets"] = budgets(smol, s)
    m["speed"] = speed(smol, s)
    m["attention_share"] = {c: attention_share(smol, c) for c in s["contexts"]}
    m["rollback"] = rollback(smol, s)
    m["engine"] = engine_runs(smol, s)
    m["prefix"] = prefix_hits(smol, s)
    m["timeline"] = verify_timeline(smol)
    m["sources"] = lookup_sources(smol, s)
    m["transformers"] = transformers_lookup(smol, s) if s["hf"] else None
    m["vllm"] = vllm_ngram(smol, s) if s["vllm"] else None
    return m


def _acceptance_values(r: dict) -> dict:
    """Acceptance (pooled over the passages) with a 95% bootstrap interval over passages, and tokens per forward."""
    lo, hi = ratio_interval([a for _, a in r["passages"]], [p for p, _ in r["passages"]])
    interval = dict(passages=len(r["passages"]), note="95% bootstrap interval over passages")
    return {"acceptance": value(100 * r["accepted"] / max(r["proposed"], 1), "%", proposed=r["proposed"]),
            "low": value(100 * lo, "%", **interval), "high": value(100 * hi, "%", **interval),
            "per_step": value(r["tokens"] / max(r["steps"], 1), "tokens", note="new tokens per target forward")}


NAMES = {"plain": "plain decoding", "lookup": "prompt lookup", "window": "self-draft: 4 sinks + a 60-token window",
         "kivi2": "self-draft: 2-bit KIVI cache", "kivi4": "self-draft: 4-bit KIVI cache",
         "early20": "early exit: the first 20 layers", "heldout": "continuing a passage",
         "copy": "repeating a passage"}                    # what a figure or a table calls each draft and workload


def values(m: dict) -> dict:
    """The section's values, from every part of the measurements that m holds: a notebook sets each part's
    verdicts beside the book's as soon as it has measured that part (lab.book.verdicts); record() writes them all."""
    s = m["settings"]
    v = {"settings": value(s["passages"], "prompts", prompt_tokens=s["prompt"], new_tokens=s["new"],
                           threads=m["threads"], note="SmolLM2, float32, greedy, per workload")}
    if "chunk" in m:
        one = m["chunk"][1]
        v["chunk"] = {f"n{n}": {"ms": value(t * 1e3, "ms"), "over_one": value(t / one, "x")}
                      for n, t in m["chunk"].items()}
        v["chunk"]["context"] = value(256, "tokens", note="a StaticCache holding this many positions")
    if "acceptance" in m:
        a = m["acceptance"]
        v["acceptance"] = {w: {d: {f"k{k}": _acceptance_values(r) | {
            "identical": value(r["identical"], None, note="tokens equal plain greedy decoding's")}
            for k, r in ks.items()} for d, ks in ds.items()} for w, ds in a["runs"].items()}   # speed: see "speed"
        v["acceptance"]["identical"] = value(all(r["identical"] for ds in a["runs"].values() for ks in ds.values()
                                                 for r in ks.values()), None, note="every draft, k and workload")
        for w, ds in a["runs"].items():                     # the ends of the sweep over k, whatever ks ran
            for d, ks in ds.items():
                for end, k in (("smallest_k", min(ks)), ("largest_k", max(ks))):
                    r = ks[k]
                    v["acceptance"][w][d][end] = value(100 * r["accepted"] / max(r["proposed"], 1), "%", k=k)
    if "sources" in m:
        share = lambda x, n: 100 * x["output"][n] / max(x["output"][n] + x["prompt"][n], 1)   # noqa: E731
        v["sources"] = {w: {src: {"proposed": value(t["proposed"], "tokens"),
                                  "acceptance": value(100 * t["accepted"] / max(t["proposed"], 1), "%")}
                            for src, t in x.items()} | {
            "output_share": value(share(x, "proposed"), "%",
                                  note="prompt lookup's guesses (k = 4) copied from the model's own output"),
            "output_accepted_share": value(share(x, "accepted"), "%",
                                           note="of the accepted guesses, those copied from the model's output")}
            for w, x in m["sources"].items()}
    if "budgets" in m:
        v["budgets"] = {n: _acceptance_values(r) for n, r in m["budgets"].items()}
        v["budgets"]["prompt"] = value(s["budget_prompt"], "tokens", note="held-out passages, k = 4")
        v["budgets"]["passages"] = value(s["budget_passages"], "passages")
    if "speed" in m:
        v["speed"] = {f"c{c}": {d: {"tok_s": value(r["tok_s"], "tokens/s", seconds=r["seconds"]),
                                    "per_step": value(r["per_step"], "tokens"),
                                    "identical": value(r["identical"], None)} | (
            {"speedup": value(r["tok_s"] / x["plain"]["tok_s"], "x"),
             "acceptance": value(100 * float(np.nan_to_num(r["acceptance"])), "%", note="0 where nothing was proposed")}
            if d != "plain" else {})
            for d, r in x.items()} | {"attention_share": value(100 * m["attention_share"][c], "%",
                                                               note="the cache's share of a decode step's bytes")}
            for c, x in m["speed"].items()}
        drafts = [d for d in s["speed_drafts"] if d != "lookup"]            # the drafts that run the model
        gains = {d: [x[d]["tok_s"] / x["plain"]["tok_s"] for x in m["speed"].values()] for d in s["speed_drafts"]}
        v["speed"]["lookup_min_speedup"] = value(min(gains["lookup"]), "x", contexts=list(m["speed"]),
                                                 note="prompt lookup's smallest speedup over the contexts measured")
        v["speed"]["model_drafts_max_speedup"] = value(max(g for d in drafts for g in gains[d]), "x", drafts=drafts,
                                                       contexts=list(m["speed"]),
                                                       note="the largest speedup of any draft that runs the model")
    if "rollback" in m:
        v["rollback"] = {d: {"crop_us": value(r["crop_us"], "µs"), "step_ms": value(r["step_ms"], "ms"),
                             "crop_share": value(100 * r["crop_us"] / 1e3 / r["step_ms"], "%",
                                                 note="of one decode step"),
                             "pages_freed": value(r["pages_freed"], "pages"),
                             "pages_reserved": value(r["pages_reserved"], "pages")}
                         for d, r in m["rollback"].items()}
        v["rollback"]["context"] = value(s["rollback_context"] - 4, "tokens", note="the prefill; then 9 verify "
                                         "positions cross a page boundary and 8 of them are taken back")
    if "engine" in m:
        v["engine"] = {f"c{c}": {d: {"tok_s": value(r["tok_s"], "tokens/s")} | (
            {"acceptance": value(100 * r["accepted"] / max(r["proposed"], 1), "%"),
             "lookahead_pages": value(r["lookahead_pages"], "pages"),
             "rollback_pages": value(r["rollback_pages"], "pages"),
             "identical": value(r["identical"], None), "speedup": value(r["tok_s"] / x["plain"]["tok_s"], "x")}
            if d == "lookup" else {}) for d, r in x.items()} for c, x in m["engine"].items()}
        for end, c in (("one", min(m["engine"])), ("many", max(m["engine"]))):   # the ends, whatever levels ran
            v["engine"][end] = {"requests": value(c, "requests"), "speedup": v["engine"][f"c{c}"]["lookup"]["speedup"],
                                "identical": v["engine"][f"c{c}"]["lookup"]["identical"]}
    if "prefix" in m:
        p = m["prefix"]
        v["prefix"] = {"plain_cached": value(p["plain"]["cached_tokens"], "tokens"),
                       "lookup_cached": value(p["lookup"]["cached_tokens"], "tokens",
                                              accepted=p["lookup"]["accepted"], proposed=p["lookup"]["proposed"]),
                       "equal": value(p["equal"], None, turns=s["turns"]), "identical": value(p["identical"], None)}
    if "timeline" in m:
        t = m["timeline"]
        v["timeline"] = {k: value(x, "pages" if k.startswith("pages") else None) for k, x in t.items()}
    if "transformers" in m:
        h = m["transformers"]
        v["transformers"] = not_run("quick settings without transformers") if h is None else {
            **{k: value(x, "s") for k, x in h.items() if k.endswith("_s")},
            "hf_speedup": value(h["hf_plain_s"] / h["hf_lookup_s"], "x"),
            "lab_speedup": value(h["lab_plain_s"] / h["lab_lookup_s"], "x"),
            "lab_over_hf": value(h["hf_lookup_s"] / h["lab_lookup_s"], "x",
                                 note="the lab's lookup speed / transformers'"),
            "same_tokens": value(h["same_tokens"], None), "agreement": value(100 * h["agreement"], "%")}
    if "vllm" in m:
        r = m["vllm"]
        v["vllm"] = not_run("vLLM's environment is not built (`make vllm`) or quick mode") if r is None else {
            "acceptance": value(100 * r["k4"]["accepted_tokens"] / max(r["k4"]["draft_tokens"], 1), "%",
                                draft_tokens=r["k4"]["draft_tokens"], vllm=r["k4"]["vllm"]),
            "speedup": value(r["k0"]["seconds"] / r["k4"]["seconds"], "x", note="whole requests, plain / ngram"),
            "lab_acceptance": value(100 * r["lab_accepted"] / max(r["lab_proposed"], 1), "%",
                                    proposed=r["lab_proposed"]),
            "draft_tokens": value(r["k4"]["draft_tokens"], "tokens", note="guesses vLLM made on these prompts"),
            "lab_draft_tokens": value(r["lab_proposed"], "tokens", note="the lab's prompt lookup's, the same prompts"),
            "agreement": value(100 * r["agreement"], "%", note="tokens equal to the lab's, position by position")}
    return v


COLORS = {"plain": "tab:gray", "lookup": "tab:blue", "window": "tab:orange", "kivi2": "tab:green",
          "early20": "tab:red"}                                  # one color per draft in every figure


def plot_acceptance(runs: dict, path=None):
    """Acceptance against k, one line per draft, a panel per workload."""
    fig, axes = plots.figure(ncols=len(runs), sharey=True, height=4.0)
    axes = np.atleast_1d(axes)
    for ax, (w, ds) in zip(axes, runs.items(), strict=True):
        for d, ks in ds.items():
            xs = sorted(ks)
            ax.plot(xs, [100 * ks[k]["accepted"] / max(ks[k]["proposed"], 1) for k in xs], marker="o",
                    label=NAMES.get(d, d), color=COLORS.get(d))
        ax.set(xscale="log", xlabel="k (guesses per step)", title=NAMES.get(w, w))
        ax.set_xticks(xs, [str(k) for k in xs])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].set(ylabel="guesses accepted (%)", ylim=(0, 105))
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncols=2, frameon=False)
    return finish(fig, path, rect=(0, 0.16, 1, 1))                    # the legend below both panels


def plot_speed(speed: dict, path=None):
    """Decode tokens per second against context, plain and speculative."""
    fig, ax = plots.figure(height=4.2)
    cs = sorted(speed)
    for d in speed[cs[0]]:
        ax.plot(cs, [speed[c][d]["tok_s"] for c in cs], marker="o", label=NAMES.get(d, d), color=COLORS.get(d))
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode tokens / s",
           title="Speculative and plain")
    plots.log_ticks(ax.yaxis)                                   # plain numbers: 2, 5, 10, 20, 50
    ax.set_xticks(cs, [f"{c:,}" for c in cs])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=2, frameon=False)
    return finish(fig, path)


def plot_timeline(t: dict, path=None):
    """One verify step: the positions it fed (the last token and k guesses), which were accepted, which
    rolled back, and the page boundaries, with the pages the crop gave back."""
    fig, ax = plots.figure(height=3.2)
    P, start, k, a = t["page_size"], t["start"], t["guesses"], t["accepted"]
    colors = ["tab:blue"] + ["tab:green"] * a + ["tab:red"] * (k - a)
    labels = ["last token"] + ["accepted"] * a + ["rolled back"] * (k - a)
    seen = set()
    for i, (c, lab) in enumerate(zip(colors, labels, strict=True)):
        ax.bar(start + i, 1, color=c, label=None if lab in seen else lab, width=0.9)
        seen.add(lab)
    boundaries = range((start // P + 1) * P, start + k + 1, P)
    freed = [b for b in boundaries if b >= start + 1 + a]   # pages of rejected positions only: the crop gives them back
    for b in boundaries:
        ax.axvline(b - 0.5, color="black", lw=1, label=None if b > boundaries[0] else f"page boundary (pages of {P})")
    for b in freed:
        ax.axvspan(b - 0.5, min(b + P, start + k + 1) - 0.5, ymax=0.85, fill=False, hatch="//", edgecolor="0.5",
                   lw=0, label=None if b > freed[0] else "page given back")
    ax.set(yticks=[], xlabel="position", title=f"One verify step: {a} of {k} guesses kept, "
                                               f"{t['pages_freed']} page(s) given back")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=3, frameon=False)
    ax.set_ylim(0, 1.2)
    return finish(fig, path)


def record(m: dict, drawn: dict | None = None) -> dict:
    """Write section ch09 and its figures. drawn: figures already drawn (a notebook's), saved, not redrawn."""
    figs, drawn, v = figures_dir(), drawn or {}, values(m)
    draw = {"acceptance": lambda p: plot_acceptance(m["acceptance"]["runs"], p),
            "speed": lambda p: plot_speed(m["speed"], p)}
    if m["timeline"]:
        draw["timeline"] = lambda p: plot_timeline(m["timeline"], p)
    for name, plot in draw.items():
        path = figs / f"ch09_{name}.png"
        finish(drawn[name], path) if name in drawn else plot(path)
    captions = {"acceptance": "Guesses accepted against k, per draft and workload",
                "speed": "Decode tokens per second against context, speculative and plain",
                "timeline": "One verify step in the engine: accepted, rolled back, pages freed"}
    figures = {n: {"path": figs / f"ch09_{n}.png", "caption": captions[n]} for n in draw}
    write_section(SECTION, v, provenance(manifest=m["manifest"]), figures=figures)
    return v
