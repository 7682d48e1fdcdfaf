# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 9 — Speculation and rollback
#
# A decode step reads every weight of the model to produce one token. Feeding it five tokens instead of
# one costs far less than five steps: the weights are read once either way (the book measures 1.7 times
# one step on SmolLM2; the cell below measures it on your machine). **Speculative decoding** spends that
# slack. A cheap *draft* guesses the next k tokens; the model (the *target*) runs its last token and the
# k guesses as one chunk through its cache, and keeps the guesses that equal what it would have chosen
# itself, plus one token of its own. Greedy output stays exactly the target's.
#
# The cache is where it gets hard. The chunk wrote k positions; after a rejection, some of them belong to
# tokens that never happened. They must vanish from every structure that saw them: the cache, its pages,
# the block table, the names prefix caching gives to full pages. This notebook builds the verify loop by
# hand over a StaticCache, checks it against `lab`, rolls back every cache design, and then measures:
# how often each draft is right, when guessing pays on a CPU, and what a rollback costs.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import platform

import pandas as pd
import torch
from IPython.display import display

from lab import data, results
from lab.cache import EvictingCache, PagedCache, StaticCache
from lab.engine import PromptLookup, ServingEngine, SpecInputError, speculative_generate
from lab.engine.speculative import NoDraft
from lab.experiments import ch09_speculation as ch09
from lab.experiments.tables import show
from lab.models import forward_cached, load
from lab.book.verdicts import beside

print(f"python {platform.python_version()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
print(lab.threads.describe())
QUICK = results.quick()
S = ch09.settings(QUICK)
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())
smol = load("smollm2")
tok = smol.tokenizer

# %% [markdown]
# ## 1. Why a guess can be cheap
#
# Time one forward of 1, 2, 5 and 9 tokens through a cache holding 256 positions. Each reads the same
# weights once; the longer ones do more arithmetic with them.

# %%
chunk = ch09.chunk_cost(smol, reps=3)       # {tokens: median seconds}, a StaticCache holding 256 positions
display(show(pd.DataFrame({n: {"forward (ms)": t * 1e3, "over one token": t / chunk[1]}
                           for n, t in chunk.items()}).T.rename_axis("tokens fed")))

# %% [markdown]
# If the draft is right often enough, one forward gives several tokens.
#
# ## 2. A verify loop, by hand
#
# The draft here needs no model at all. **Prompt lookup** finds the latest earlier place where the
# context's last n tokens occurred and proposes what followed them there; on text that repeats its
# prompt (editing, quoting, summarising) it is often right. The loop:
#
# 1. the cache holds the context but its last token, t;
# 2. the draft proposes g guesses (at most k);
# 3. one forward of t and the guesses gives the target's own greedy choice after each of them;
# 4. the guesses are accepted while they equal those choices, and the choice after the last accepted
#    one comes free;
# 5. `crop` takes the rejected guesses' positions out of the cache.

# %%
@torch.inference_mode()
def verify_loop(model, prompt, n_new, k=4, n=3):
    cache = StaticCache(model.config, len(prompt) + n_new + k)
    run = lambda ids: forward_cached(torch.tensor([ids]), model.weights, model.config, cache)[0]  # noqa: E731
    tokens, draft = [int(run(prompt)[-1].argmax())], PromptLookup(n)
    while len(tokens) < n_new:
        context = prompt + tokens
        guess = draft.propose(context, min(k, n_new - len(tokens) - 1))
        greedy = run([context[-1]] + guess).argmax(-1).tolist()   # the target's choice after t and each guess
        a = 0
        while a < len(guess) and guess[a] == greedy[a]:
            a += 1
        cache.crop(len(context) + a)                              # keep t and the accepted guesses
        tokens += guess[:a] + [greedy[a]]                          # and the target's next token
    return tokens[:n_new]


passage = data.passages(tok, 200, count=2)[1]
prompt = data.repeat_request(tok, passage)        # a chat turn: "Repeat the following passage exactly ..."
mine = verify_loop(smol, prompt, 32)
spec = speculative_generate(smol, prompt, 32, PromptLookup(3), k=4)
plain = speculative_generate(smol, prompt, 32, NoDraft())      # one token per forward: plain greedy decoding
assert mine == spec.tokens == plain.tokens
print(repr(tok.decode(mine)))
print(f"{spec.accepted} of {spec.proposed} guesses accepted; {spec.steps - 1} forwards after the prefill "
      f"instead of {plain.steps - 1}")

# %% [markdown]
# Same tokens as `lab`'s `speculative_generate` and as plain greedy decoding, in fewer forwards. The
# tokens are equal by construction: a guess is kept only where it equals the target's own greedy choice.
# The forwards are not free, though: the chunk runs the offset causal mask of chapter 2 over k + 1
# queries, and the draft costs what it costs.
#
# With sampling instead of greedy decoding, "equal to the target's choice" becomes a coin:
# `speculative_generate(..., temperature=0.7)` keeps guess $x$ with probability $\min(1, p(x)/q(x))$ and
# replaces the first rejected one by a draw from the leftover $\max(0, p - q)$, the rule of Leviathan et
# al., which leaves the output distributed exactly as the target's (tests/test_speculative.py checks it
# by counting).
#
# ## 3. Taking positions back, in every design
#
# A paged cache shows what a crop has to do. Prefill 30 positions in pages of 16, run a verify chunk of
# t and 8 guesses, and reject them all:

# %%
paged = PagedCache(smol.config, 256, page_size=16)
ids = torch.tensor([passage[:39]])
with torch.inference_mode():
    forward_cached(ids[:, :30], smol.weights, smol.config, paged)
    before = paged.manager.block_table(paged.seqs[0])
    forward_cached(ids[:, 30:], smol.weights, smol.config, paged)       # t and 8 guesses: positions 30 .. 38
    during = paged.manager.block_table(paged.seqs[0])
    paged.crop(31)                                                     # every guess rejected: keep t
after = paged.manager.block_table(paged.seqs[0])
print(f"block table {before} -> {during} with the guesses -> {after} after the crop; "
      f"{paged.manager.num_free} of {paged.manager.num_pages} pages free")

# %% [markdown]
# The third page held only rejected positions, so it went back to the pool. Each design's `crop` does
# its own version: a StaticCache moves its length back (the slots are overwritten later), a ConcatCache
# slices its tensors, a quantized cache rebuilds its float tail from the last whole group. An evicting
# cache cannot take part as the target: it evicts after every forward, so a crop cannot bring back what
# the verify chunk made it drop, and the chunk's queries would attend to positions plain decoding would
# already have evicted. `speculative_generate` refuses it with a typed error:

# %%
try:
    speculative_generate(smol, prompt, 8, PromptLookup(3), cache=lambda: EvictingCache(smol.config, 64, "window"))
except SpecInputError as e:
    print("SpecInputError:", e)

# %% [markdown]
# As a *draft's* cache it is fine, and that is the second kind of draft: the target's own weights over a
# small cache of chapter 7 (`SelfDraft`), as MagicDec, TriForce and QuantSpec do. The draft keeps its own
# cache, and rolls it back too; where it cannot (an evicted position), it starts over.
#
# ## 4. In the serving engine
#
# `ServingEngine(..., draft=PromptLookup(3), k=4)` speculates per request. Before each step, every
# decoding request's draft guesses, and pages for the guesses (lookahead) are reserved from the free
# pages only: speculation never preempts anyone. All requests' guesses are verified in the same ragged
# step. Afterwards each sequence is cropped to its accepted tokens, and pages are named for prefix
# caching only once every token in them is accepted. The copy request from above, in the engine:

# %%
engine = ServingEngine(smol, num_pages=64, page_size=16, draft=PromptLookup(3), k=4)
assert engine.generate([prompt], 32) == [plain.tokens]               # the tokens of plain greedy decoding
st = engine.stats
print(f"{st['steps']} engine steps; {st['accepted']} of {st['proposed']} guesses accepted; "
      f"{st['lookahead_pages']} lookahead pages reserved, {st['rollback_pages']} given back by a crop")

# %% [markdown]
# One verify step of a real request, drawn: the first step in which some guesses held, some did not, and
# the crop gave a page back.

# %%
tl = ch09.verify_timeline(smol)
print(f"step {tl['step']}: positions {tl['start']} .. {tl['start'] + tl['guesses']} fed (the last token and "
      f"{tl['guesses']} guesses), {tl['accepted']} guesses accepted; the sequence held {tl['pages_held']} pages "
      f"during the step and the crop gave {tl['pages_freed']} back")
fig_timeline = ch09.plot_timeline(tl)

# %% [markdown]
# ## 5. Measuring
#
# ### How often is each draft right?
#
# Four drafts, on two workloads of held-out text: continuing a passage, and repeating one (a chat turn
# asking for it word for word). Prompt lookup (n = 3); the model over 4 sink tokens and a 60-token window;
# the model over a 2-bit KIVI cache; the model's first 20 of its 30 layers, then its norm and head
# (LayerSkip without the training that makes early layers predict). The interval is a bootstrap over the
# passages: with a handful of them it is wide, and it says how far another handful could move the share.
# Where only one passage had any guesses (a quick run's short passages can leave prompt lookup with
# nothing to find in the other), there is nothing to resample, and the interval shrinks to that
# passage's own share.

# %%
from lab.metrics import ratio_interval  # noqa: E402

acc = ch09.acceptance(smol, S)
rows = {}
for w, ds in acc["runs"].items():
    for d, ks in ds.items():
        for k, r in ks.items():
            lo, hi = ratio_interval([a for _, a in r["passages"]], [p for p, _ in r["passages"]])
            rows[ch09.NAMES[w], ch09.NAMES[d], k] = {"accepted (%)": 100 * r["accepted"] / max(r["proposed"], 1),
                                                     "95% interval": f"{100 * lo:.0f}–{100 * hi:.0f}",
                                                     "tokens per forward": r["tokens"] / max(r["steps"], 1),
                                                     "tokens": r["identical"]}
display(show(pd.DataFrame(rows).T.rename_axis(["workload", "draft", "k"]),
             words={"tokens": ("identical", "different")},
             caption=f"{S['passages']} passages per workload, {S['new']} new tokens each"))
fig_acceptance = ch09.plot_acceptance(acc["runs"])

# %% [markdown]
# Where do prompt lookup's guesses come from? On the copy task, from the passage in the prompt. On plain
# continuation there is no passage to copy, yet it is often right: a small greedy model soon repeats
# itself, and lookup copies the repetition, or it finds the passage's own repeats (speaker names, stage
# directions). A sample, and where the guesses were copied from. A quick run writes a dozen tokens per
# passage, too few for the model to repeat its own output, so its guesses may all come from the prompt;
# the book's run writes 48, and most accepted guesses on continuation come from the model's output.

# %%
passage = ch09.prompts(smol, S["prompt"], 1)["heldout"][0]
print(repr(tok.decode(ch09.plain_tokens(smol, passage, 32))))
sources = ch09.lookup_sources(smol, S)
display(show(pd.DataFrame({(ch09.NAMES[w], src): {"guesses": t["proposed"],
                                                  "accepted (%)": 100 * t["accepted"] / max(t["proposed"], 1)}
                           for w, x in sources.items() for src, t in x.items()}).T
             .rename_axis(["workload", "copied from"]),
             caption="prompt lookup, k = 4: guesses copied from the prompt or from the model's own output"))

# %% [markdown]
# Every speculative run gave plain greedy decoding's tokens. Acceptance is not speed, though: a draft
# that runs the whole model per guess costs about one forward per guess.
#
# ### A smaller draft cache: how small?

# %%
bud = ch09.budgets(smol, S)
cache_names = {"full": "the full cache (the target itself)", "kivi2": "KIVI, 2 bits", "kivi4": "KIVI, 4 bits"}
cache_names |= {f"window_{w}": f"4 sinks and {w - 4} recent positions ({w} in all)" for w in S["budgets"]}
display(show(pd.DataFrame({cache_names.get(n, n): {"accepted (%)": 100 * r["accepted"] / max(r["proposed"], 1),
                                                   "tokens per forward": r["tokens"] / max(r["steps"], 1)}
                           for n, r in bud.items()}).T.rename_axis("draft cache"),
             caption=f"SelfDraft, k = 4, held-out text of {S['budget_prompt']} tokens"))
m = dict(settings=S, manifest=smol.manifest, threads=torch.get_num_threads(), acceptance=acc, sources=sources,
         budgets=bud)
beside("ch09", "ch09.acceptance", "ch09.sources", "ch09.budgets", values=ch09.values(m),
       why=f"your run has {S['passages']} passages per workload and {S['new']} new tokens each, the book "
           f"{ch09.settings(False)['passages']} and {ch09.settings(False)['new']}: a few dozen guesses per draft, "
           f"so every share swings by tens of points; and over a passage of {S['budget_prompt']} tokens a "
           "window of 128 holds most of the context, and a 2-bit KIVI cache keeps its newest 128 positions in "
           "full precision, so both drafts are nearly the target itself.")

# %% [markdown]
# ### When does it pay?
#
# Tokens per second after the prefill, plain and speculative, at growing contexts, on a passage that
# starts over (so prompt lookup has something to find). The last column is the cache's share of the bytes
# a decode step reads: the most a draft over a smaller cache can save per guess.

# %%
speed = ch09.speed(smol, S)
display(show(pd.DataFrame({c: {**{f"{ch09.NAMES[d]} (tokens/s)": r["tok_s"] for d, r in x.items()},
                               "cache's share of a step's bytes": ch09.attention_share(smol, c)}
                           for c, x in speed.items()}).T.rename_axis("context"),
             percent=["cache's share of a step's bytes"]))
fig_speed = ch09.plot_speed(speed)
m |= dict(chunk=chunk, speed=speed, attention_share={c: ch09.attention_share(smol, c) for c in S["contexts"]})
beside("ch09", "ch09.speed", "ch09.chunk", values=ch09.values(m),
       why="your run times two contexts, one draft that runs the model and a few tokens, once each, on a "
           "machine doing other things.")

# %% [markdown]
# Prompt lookup costs nothing to run and pays whenever it is right. A self-draft runs the same weights
# for every guess, and at these contexts the weights are almost all of a step's bytes, so each guess
# costs nearly a full step: it can only pay where the cache's bytes dominate, at long contexts or many
# sequences per step (which is where MagicDec and TriForce measure their gains).
#
# ### What a rollback costs
#
# Each design is prefilled, fed a verify chunk of 9 positions that crosses a page boundary, and cropped
# back to reject all 8 guesses; then one ordinary decode step runs. "pages freed" counts the pages the
# paged cache's crop gave back; "pages reserved again" the pages the next step had to reserve afresh (none
# when the next position falls in a page the sequence kept). Only the paged cache has pages.

# %%
rb = ch09.rollback(smol, S)
display(show(pd.DataFrame({d: {"crop (µs)": r["crop_us"], "decode step (ms)": r["step_ms"],
                               "pages freed": r["pages_freed"], "pages reserved again": r["pages_reserved"]}
                           for d, r in rb.items()}).T.rename_axis("design")))
m["rollback"] = rb
beside("ch09", "ch09.rollback", values=ch09.values(m))

# %% [markdown]
# ### The engine, and prefix caching

# %%
eng = ch09.engine_runs(smol, S)
display(show(pd.DataFrame({(c, d): {"output (tokens/s)": r["tok_s"]} for c, x in eng.items()
                           for d, r in x.items()}).T.rename_axis(["requests", "draft"])))
hits = ch09.prefix_hits(smol, S)
print(f"positions from named pages: {hits['plain']['cached_tokens']} without speculation, "
      f"{hits['lookup']['cached_tokens']} with ({hits['lookup']['accepted']} of {hits['lookup']['proposed']} "
      f"guesses accepted); answers {'identical' if hits['identical'] else 'different'}")
m |= dict(engine=eng, prefix=hits, timeline=tl)
beside("ch09", "ch09.engine", "ch09.prefix", "ch09.timeline", values=ch09.values(m),
       why=f"your run has {max(S['engine_levels'])} requests in flight at most, the book "
           f"{max(ch09.settings(False)['engine_levels'])}, and shorter ones.")

# %% [markdown]
# Equal hits are the point: an engine that named a page while it still held rejected guesses would
# serve those positions to the next turn, or lose the hit.
#
# ### transformers' prompt lookup, and vLLM's

# %%
hf = ch09.transformers_lookup(smol, S)
print(f"transformers: plain {hf['hf_plain_s']:.2f} s, prompt lookup {hf['hf_lookup_s']:.2f} s; the lab: plain "
      f"{hf['lab_plain_s']:.2f} s, prompt lookup {hf['lab_lookup_s']:.2f} s; the tokens "
      f"{'are the same' if hf['same_tokens'] else 'differ'}")
book = results.read(results.COMMITTED)["sections"].get("ch09", {}).get("values", {}).get("vllm", {})
if book.get("value") == results.NOT_RUN or "acceptance" not in book:
    print("the book's results have no vLLM run:", book.get("reason", "not measured yet: run `make results`"))
else:
    print(f"vLLM's ngram method (the book's run): {book['acceptance']['value']:.0f}% of draft tokens accepted, "
          f"{book['speedup']['value']:.2f}× plain; tokens equal to the lab's: {book['agreement']['value']:.0f}%")
m |= dict(transformers=hf, vllm=None)
beside("ch09", "ch09.transformers", "ch09.vllm", values=ch09.values(m))

# %% [markdown]
# ## Record

# %%
ch09.record(m, drawn={"acceptance": fig_acceptance, "speed": fig_speed, "timeline": fig_timeline})
print("wrote section ch09 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# 1. **The acceptance rule.** Write `accept(p, q, guess, generator)`: p `[k + 1, V]` are the target's
#    probabilities after the context and after each guess, q `[k, V]` the draft's, `guess` k ids drawn
#    from q. Keep guess $i$ with probability $\min(1, p_i(x)/q_i(x))$; at the first rejection, draw from
#    $\max(0, p_i - q_i)$ normalised and stop; if every guess is kept, draw one more token from $p_k$.
#    The check, `ex.check_acceptance(accept)`, runs it thousands of times on drafts you have not seen and
#    compares the law of everything it emits (the kept guesses and the token after them) with the rule's
#    exact law, computed from p and q, by a chi-square test; it also checks that the first token follows
#    $p_0$ and that the first guess is kept at the rate $\sum_x \min(p_0(x), q_0(x))$. Accepting
#    everything fails, so does accepting nothing, and so does a shortcut that skews what follows a
#    rejection by more than the test can tell from chance (a small skew can pass).
# 2. **Roll a cache back.** `ex.ListCache` keeps each layer's keys and values as a list of the chunks each
#    forward stored, and has no `crop`. Write `rollback(cache, n)` that leaves it holding the first n
#    positions. The check runs verify steps on the tiny model with a draft that is wrong at known places,
#    calls your rollback after each, and inspects the cache: its length, every layer's stored positions bit
#    for bit, the next logits against recomputation without a cache, and the tokens against plain greedy
#    decoding. Doing nothing fails, and so does keeping one position too many.
# 3. **Open-ended: when does lookup stop paying?** `ex.measure_acceptance(k=4, n=3)` measures prompt
#    lookup's acceptance on the copy workload and sets it beside the book's. Vary n and k, and try a prompt
#    with nothing to copy (`lab.data.passages` alone). Where does acceptance fall, and what does that do
#    to the tokens per forward?

# %%
from lab.exercises import ch09 as ex  # noqa: E402


def accept(p, q, guess, generator=None):
    raise NotImplementedError("your answer")


def rollback(cache, n):
    raise NotImplementedError("your answer")


for check, answer in ((ex.check_acceptance, accept), (ex.check_rollback, rollback)):
    try:
        check(answer)
    except NotImplementedError:
        print(f"{check.__name__}: not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch09_solutions.py`; the test suite runs every check on them.
