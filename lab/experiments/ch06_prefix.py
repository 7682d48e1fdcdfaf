"""Chapter 6, "Prefix caching": how much of a workload the pages already hold, what a hit saves in time to
first token, what naming pages costs, what a shared cache tells another tenant, what caching saves in money,
and the lab against vLLM on the same requests.

The workloads are SYNTHETIC: random token ids arranged in the shapes of real traffic (applications with long
system prompts, multi-turn chats, few-shot prompts). Hit rates depend only on which tokens repeat, so the
hit-rate sweep runs the backend's own bookkeeping without the model (`PrefixCachingBackend.dry_run`, tested
to count exactly what scoring counts). Times are SmolLM2 on this CPU.
"""

import itertools
import random
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import data
from ..bench import time_rounds
from ..engine import PrefixCachingBackend, block_hashes
from ..models import load
from ..results import figures_dir, not_run, provenance, quick, value, write_section
from . import plots
from .plots import finish

SECTION = "ch06"
PAGE = 16                       # the lab's page size; the comparison with vLLM uses 32 (its CPU backend's)
SUFFIX = 16                     # new tokens after the cached prefix, in the time-to-first-token measurement
SYNTHETIC = "synthetic workload: random token ids in the shape of real traffic (lab.experiments.ch06_prefix)"


def settings(quick_mode: bool) -> dict:
    if quick_mode:
        return dict(scale=0.5, pool_fractions=(0.05, 0.1, 0.2, 0.4, 0.7, 1.0), prefixes=(64, 256, 1024),
                    ttft_rounds=5, trials=200, hash_tokens=4096, vllm=False)
    return dict(scale=1.0, pool_fractions=(0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.55, 0.7, 0.85, 1.0),
                prefixes=(32, 64, 128, 256, 512, 1024, 1536), ttft_rounds=15, trials=400, hash_tokens=65536,
                vllm=True)


# ---- synthetic workloads: lists of requests (token ids), in arrival order ----------------------------------

def _tokens(rng, n, vocab):
    return [rng.randrange(vocab) for _ in range(n)]


def shared_system_prompts(vocab, scale=1.0, seed=0) -> list:
    """Eight applications, each with its own long system prompt (500-1,500 tokens), chosen by Zipf
    popularity (the first is the most used); each request is a system prompt and a user's question of
    20-150 tokens."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(500, 1500), vocab) for _ in range(8)]
    weights = [1 / (k + 1) ** 1.1 for k in range(len(systems))]
    return [rng.choices(systems, weights)[0] + _tokens(rng, rng.randint(20, 150), vocab)
            for _ in range(int(300 * scale))]


def multi_turn_chats(vocab, scale=1.0, seed=1, turns=6) -> list:
    """Conversations of `turns` turns, interleaved in random order. Every chat starts with the same
    300-token system prompt; each turn's prompt is the previous prompt, the previous reply (50-250 tokens)
    and a new user message (20-120 tokens)."""
    rng = random.Random(seed)
    system = _tokens(rng, 300, vocab)
    chats = [list(system) for _ in range(int(48 * scale))]
    order = [c for c in range(len(chats)) for _ in range(turns)]
    rng.shuffle(order)                       # a chat's turns stay in order; chats interleave
    out = []
    for c in order:
        if len(chats[c]) > len(system):      # not the first turn: the reply to the last prompt came back
            chats[c] += _tokens(rng, rng.randint(50, 250), vocab)
        chats[c] += _tokens(rng, rng.randint(20, 120), vocab)
        out.append(list(chats[c]))
    return out


def few_shot_prompts(vocab, scale=1.0, seed=2) -> list:
    """Four tasks, each with six fixed examples of 80-160 tokens behind a 60-token instruction; each request
    is a task's instruction and examples, then a query of 30-80 tokens. Tasks are equally likely."""
    rng = random.Random(seed)
    tasks = [_tokens(rng, 60, vocab) + sum((_tokens(rng, rng.randint(80, 160), vocab) for _ in range(6)), [])
             for _ in range(4)]
    return [rng.choice(tasks) + _tokens(rng, rng.randint(30, 80), vocab) for _ in range(int(200 * scale))]


WORKLOADS = {"system prompts": shared_system_prompts, "multi-turn chats": multi_turn_chats,
             "few-shot": few_shot_prompts}


def shape(requests, page_size=PAGE) -> dict:
    """What a workload looks like: requests, prompt lengths, its distinct full pages (the pool that would
    never evict), and the best hit rate any pool could reach (every page computed once)."""
    lengths = [len(r) for r in requests]
    distinct = len({d for r in requests for d in block_hashes(r, page_size)})
    return dict(requests=len(requests), mean_tokens=float(np.mean(lengths)), max_tokens=max(lengths),
                tokens=sum(lengths), distinct_pages=distinct)


# ---- hit rate against pool size -------------------------------------------------------------------------

def hit_rate(model, requests, num_pages, page_size=PAGE) -> dict:
    """Serve the requests in order from one pool of `num_pages` (LRU eviction); the backend's stats."""
    backend = PrefixCachingBackend(model, num_pages, page_size)
    for ids in requests:
        backend.dry_run(ids)
    s = backend.stats
    return dict(s, hit_rate=s["cached_tokens"] / (s["cached_tokens"] + s["computed_tokens"]), num_pages=num_pages)


def hit_rate_sweep(model, workloads: dict, fractions, page_size=PAGE) -> dict:
    """{workload: {"shape": shape, "runs": [hit_rate at each pool size]}}; pool sizes are fractions of the
    workload's distinct pages, never below what its longest request needs."""
    out = {}
    for name, requests in workloads.items():
        sh = shape(requests, page_size)
        floor = -(-sh["max_tokens"] // page_size)
        sizes = sorted({max(floor, round(f * sh["distinct_pages"])) for f in fractions})
        out[name] = dict(shape=sh, runs=[hit_rate(model, requests, n, page_size)
                                         for n in tqdm(sizes, desc=f"hit rate: {name}")])
    return out


# ---- time to first token, hit against miss ----------------------------------------------------------------

@torch.inference_mode()
def ttft(model, prefixes, rounds=9, suffix=SUFFIX, page_size=PAGE) -> dict:
    """Time to first token (one next_logits call) for a prompt of `prefix + suffix` tokens whose prefix is
    cached (hit) or not (miss: a fresh salt every call, so nothing is found), timed in alternating rounds.
    {prefix: {"hit": summary, "miss": summary, "cached": tokens a hit found}}."""
    out = {}
    for L in tqdm(prefixes, desc="time to first token"):
        ids = data.passages(model.tokenizer, L + suffix, count=1, seed=L)[0]
        need = -(-(L + suffix) // page_size)
        backend = PrefixCachingBackend(model, 3 * need + 1, page_size)  # a hit's pages and two misses'
        salts = (f"miss-{i}" for i in itertools.count())
        before = dict(backend.stats)
        r = time_rounds({"hit": lambda b=backend, x=ids: b.next_logits(x, salt="hit"),
                         "miss": lambda b=backend, x=ids, s=salts: b.next_logits(x, salt=next(s))},
                        warmup=1, rounds=rounds)
        r["cached"] = (L + suffix - 1) // page_size * page_size
        # every timed hit found its prefix (the warm-up's did not), and no miss found anything
        assert backend.stats["cached_tokens"] - before["cached_tokens"] == rounds * r["cached"], backend.stats
        out[L] = r | dict(ratio=r["miss"]["median"] / r["hit"]["median"], suffix=suffix)
    return out


def hashing_cost(model, n_tokens=65536, page_size=PAGE, reps=5) -> dict:
    """Seconds per token of naming pages (block_hashes over n_tokens, with the model's state identity as
    `extra`, as the backend does), median of reps."""
    from ..engine.identity import identity_of

    rng = random.Random(0)
    ids = [rng.randrange(model.config.vocab_size) for _ in range(n_tokens)]
    backend = PrefixCachingBackend(model, 1, page_size)
    extra = (identity_of(model, backend.pool, None),)
    r = time_rounds({"hash": lambda: block_hashes(ids, page_size, extra)}, warmup=1, rounds=reps)["hash"]
    return dict(per_token=r["median"] / n_tokens, tokens=n_tokens, summary=r)


# ---- the timing side channel ------------------------------------------------------------------------------

def roc(labels, scores) -> dict:
    """ROC curve and its area for `scores` (higher: more likely label 1). AUC = P(score of a 1 > score of
    a 0), ties counting a half (the Mann-Whitney statistic)."""
    labels, scores = np.asarray(labels, bool), np.asarray(scores, float)
    pos, neg = scores[labels], scores[~labels]
    auc = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))
    thresholds = np.r_[np.inf, np.sort(np.unique(scores))[::-1]]
    tpr = [(pos >= t).mean() for t in thresholds]
    fpr = [(neg >= t).mean() for t in thresholds]
    return dict(auc=float(auc), fpr=[float(x) for x in fpr], tpr=[float(x) for x in tpr])


@torch.inference_mode()
def side_channel(model, trials=200, candidates=4, page_size=PAGE, question=8, probe=16, seed=0) -> dict:
    """A victim's request starts with one of `candidates` secret system prompts (one page each). The attacker,
    another tenant on the same backend, sends a guess's first page and its own `probe` tokens and times its
    own time to first token; a guess is right in half the trials. Scored as ROC AUC of "fast means right",
    on a fresh pool each trial, once with no salt (a cache shared by all) and once with per-tenant salts.
    {"shared" | "salted": {"auc", "fpr", "tpr", "right_ms", "wrong_ms"}}."""
    rng = random.Random(seed)
    texts = data.passages(model.tokenizer, page_size + question + probe, count=candidates + 1, seed=seed + 7)
    secrets = [t[:page_size] for t in texts[:candidates]]
    victim_q, attacker_q = texts[-1][:question], texts[-1][question:question + probe]
    salts = {"shared": (None, None), "salted": ("tenant-victim", "tenant-attacker")}
    times = {case: ([], []) for case in salts}                          # (labels, seconds)
    need = 2 * -(-(page_size + probe) // page_size) + 2
    PrefixCachingBackend(model, need, page_size).next_logits(secrets[0])  # warm-up, untimed
    for t in tqdm(range(trials), desc="side channel"):
        secret = rng.randrange(candidates)
        right = rng.random() < 0.5
        guess = secret if right else rng.choice([c for c in range(candidates) if c != secret])
        for case in (list(salts) if t % 2 else list(salts)[::-1]):      # alternate which case runs first
            victim_salt, attacker_salt = salts[case]
            backend = PrefixCachingBackend(model, need, page_size)
            backend.next_logits(secrets[secret] + victim_q, salt=victim_salt)
            t0 = time.perf_counter()
            backend.next_logits(secrets[guess] + attacker_q, salt=attacker_salt)
            times[case][0].append(right)
            times[case][1].append(time.perf_counter() - t0)
    out = {}
    for case, (labels, seconds) in times.items():
        labels, seconds = np.array(labels), np.array(seconds)
        out[case] = roc(labels, -seconds) | dict(right_ms=float(np.median(seconds[labels]) * 1e3),
                                                 wrong_ms=float(np.median(seconds[~labels]) * 1e3),
                                                 trials=trials)
    return out | dict(candidates=candidates, page_size=page_size, probe=probe)


# ---- economics --------------------------------------------------------------------------------------------

# Published prices, US dollars per million input tokens, standard tier, as read on 2026-11-30; sources,
# exact sentences and which figures are secondary: research/ch06/prices.md.
PRICES = {
    "Anthropic, 5-minute cache": dict(model="Claude Sonnet 4", base=3.00, write=1.25, read=0.10, minimum=1024),
    "Anthropic, 1-hour cache": dict(model="Claude Sonnet 4", base=3.00, write=2.00, read=0.10, minimum=1024),
    "OpenAI, automatic": dict(model="gpt-4.1", base=2.00, write=1.00, read=0.25, minimum=1024, step=128),
    "Gemini, explicit cache": dict(model="Gemini 2.5 Pro", base=1.25, write=1.00, read=0.10, minimum=2048,
                                   storage=4.50, secondary=True),
}
CHAT = dict(system=3000, turns=10, user=100, reply=300, minutes_between=1.0)  # one synthetic conversation


def chat_prompts(system, turns, user, reply, **_) -> list:
    """Prompt lengths of a conversation: turn k sends the system prompt, every earlier message and reply,
    and its own message."""
    return [system + k * (user + reply) + user for k in range(turns)]


def conversation_cost(price: dict, chat=CHAT) -> dict:
    """Input cost in dollars of one conversation without and with the provider's cache, turn by turn.

    Turn k can read the previous turn's whole prompt from the cache (a cache breakpoint at the end of
    every prompt; OpenAI's automatic cache matches in 128-token steps from 1,024); what it does not read
    it pays at base price, or, where the provider charges for writing, at the write multiplier. Gemini's
    explicit cache holds only the system prompt, written once and stored for the whole conversation.
    """
    base, prompts = price["base"] / 1e6, chat_prompts(**chat)
    without = [base * n for n in prompts]
    if "storage" in price:                                    # explicit: the system prompt, stored
        hours = chat["turns"] * chat["minutes_between"] / 60
        system = chat["system"] if chat["system"] >= price["minimum"] else 0
        per_turn = [base * (price["read"] * system + n - system) for n in prompts]
        per_turn[0] += base * price["write"] * system + price["storage"] / 1e6 * system * hours
    else:
        per_turn = []
        for k, n in enumerate(prompts):
            hit = prompts[k - 1] if k and prompts[k - 1] >= price["minimum"] else 0
            if "step" in price and hit:
                hit = price["minimum"] + (hit - price["minimum"]) // price["step"] * price["step"]
            written = (n - hit) if n >= price["minimum"] else 0    # the rest of this prompt, for the next turn
            per_turn.append(base * (price["read"] * hit + price["write"] * written + (n - hit - written)))
    return dict(without=float(sum(without)), cached=float(sum(per_turn)),
                cumulative_without=np.cumsum(without).tolist(), cumulative_cached=np.cumsum(per_turn).tolist())


def economics(model, seconds_per_token, chat=CHAT, page_size=PAGE) -> dict:
    """Each provider's cost for the conversation, and what the lab's cache saves on this machine: prompt
    tokens it serves from pages over the conversation (replies included, as a real session feeds them back),
    times the measured compute time per prompt token."""
    rng = random.Random(5)
    conversation, requests = _tokens(rng, chat["system"], model.config.vocab_size), []
    for k in range(chat["turns"]):
        if k:
            conversation += _tokens(rng, chat["reply"], model.config.vocab_size)
        conversation += _tokens(rng, chat["user"], model.config.vocab_size)
        requests.append(list(conversation))
    lab = hit_rate(model, requests, -(-len(requests[-1]) // page_size) + 1, page_size)
    return dict(costs={name: conversation_cost(p, chat) for name, p in PRICES.items()}, chat=chat,
                lab_cached=lab["cached_tokens"], lab_computed=lab["computed_tokens"],
                compute_saved_s=lab["cached_tokens"] * seconds_per_token, seconds_per_token=seconds_per_token)


# ---- against vLLM ------------------------------------------------------------------------------------------

def vllm_requests(model, max_tokens=32, prefix=512, rounds=6) -> list:
    """One request sequence for both systems (page and block size 32):
    - a shared 70-token prefix with two tails, then the first request again (the tails and the repeat find
      the shared whole pages);
    - a 96-token prompt (three whole pages) twice: a fully matched prompt still runs its last token, so the
      repeat finds two pages, not three;
    - the first request's prompt and reply, then a new message: pages filled while decoding are cached too;
    - a `prefix`-token prompt with a 16-token question, warmed, then in turns the same (hit) and under a new
      cache salt (miss), max_tokens 1: their seconds are times to first token."""
    ps = data.passages(model.tokenizer, prefix + 16, count=5, seed=3)
    shared = ps[0][:70]
    first = shared + ps[1][:20]
    out = [first, shared + ps[2][:45], first, ps[3][:96], ps[3][:96]]
    reply = _greedy(model, first, max_tokens)
    out.append(first + reply + ps[2][50:70])
    long = ps[4]
    out.append({"ids": long, "max_tokens": 1, "role": "warm"})
    for i in range(rounds):
        out += [{"ids": long, "max_tokens": 1, "role": "hit"},
                {"ids": long, "max_tokens": 1, "salt": f"miss-{i}", "role": "miss"}]
    return out


def _greedy(model, ids, n):
    from ..cache import make_cache
    from ..engine import CachedBackend, generate

    return generate(CachedBackend(model, lambda: make_cache("concat", model.config, len(ids) + n)), ids, n).tokens


@torch.inference_mode()
def against_vllm(model, max_tokens=32, prefix=512, rounds=6, cores="0-1") -> dict:
    """The same requests through the lab (page size 32) and vLLM (block size 32, prefix caching on, its
    engine bound to `cores`), one after another on this machine: per request, cached tokens, tokens and
    seconds; summaries of time to first token on a hit and a miss."""
    from ..models.load import smollm2_folder
    from ..peers import compare_vllm

    requests = vllm_requests(model, max_tokens, prefix, rounds)
    send = [{k: v for k, v in r.items() if k != "role"} if isinstance(r, dict) else r for r in requests]
    theirs = compare_vllm.run(smollm2_folder(), send, block_size=32, max_tokens=max_tokens, cores=cores)
    ours = compare_vllm.lab_run(PrefixCachingBackend(model, 256, 32), send, max_tokens)
    roles = [r.get("role", "agreement") if isinstance(r, dict) else "agreement" for r in requests]

    def ttft(results, role):
        return float(np.median([r["seconds"] for r, x in zip(results, roles, strict=True) if x == role]))

    agree = [i for i, x in enumerate(roles) if x == "agreement"]
    return dict(
        vllm=theirs["vllm"], core_ids=theirs["core_ids"], lab_threads=torch.get_num_threads(),
        cached_lab=[ours[i]["num_cached_tokens"] for i in agree],
        cached_vllm=[theirs["results"][i]["num_cached_tokens"] for i in agree],
        prompt_tokens=[len(requests[i]) for i in agree],
        tokens_identical=all(ours[i]["tokens"] == theirs["results"][i]["tokens"] for i in agree),
        ttft={side: {role: ttft(res, role) for role in ("hit", "miss")}
              for side, res in (("lab", ours), ("vllm", theirs["results"]))},
        timing_cached={side: res[roles.index("hit")]["num_cached_tokens"]
                       for side, res in (("lab", ours), ("vllm", theirs["results"]))},
        prefix=prefix + 16, rounds=rounds, max_tokens=max_tokens)


# ---- figures ----------------------------------------------------------------------------------------------

def plot_hit_rate(sweep: dict, path=None):
    fig, ax = plots.figure(height=3.6)
    for name, r in sweep.items():
        distinct = r["shape"]["distinct_pages"]
        ax.plot([100 * x["num_pages"] / distinct for x in r["runs"]], [100 * x["hit_rate"] for x in r["runs"]],
                "o-", label=f"{name} ({distinct:,} distinct pages)")
    ax.set(xlabel="pool size (% of the workload's distinct pages)", ylabel="prompt tokens from cache (%)",
           ylim=(0, 100), title="Hit rate against pool size, LRU (synthetic workloads)")
    ax.legend(loc="lower right")
    return finish(fig, path)


def ttft_times(v: dict) -> dict:
    """The time-to-first-token figure's input from recorded values `v` (`record(m)`, or section ch06 of a
    results file), to redraw it without measuring: {prefix: {"hit", "miss" (medians), "ratio", "suffix"}}."""
    return {int(k[1:]): {"hit": {"median": x["hit_ms"]["value"] / 1e3}, "miss": {"median": x["miss_ms"]["value"] / 1e3},
                         "ratio": x["ratio"]["value"], "suffix": SUFFIX}
            for k, x in v["ttft"].items() if k[:1] == "T" and k[1:].isdigit()}


def plot_ttft(times: dict, path=None):
    fig, (ax, ax_ratio) = plots.figure(ncols=2, height=3.6)
    Ls = sorted(times)
    for case, marker in (("miss", "s--"), ("hit", "o-")):
        ax.plot(Ls, [times[L][case]["median"] * 1e3 for L in Ls], marker, label=case)
    ax_ratio.plot(Ls, [times[L]["ratio"] for L in Ls], "o-")
    ax.set(yscale="log", ylabel="time to first token (ms)", title="SmolLM2, CPU")
    plots.log_ticks(ax.yaxis)                                  # 100, 200, 500 ms ...: two labels at least
    ax_ratio.set(ylim=(0, None), ylabel="miss / hit", title="Speed-up of a hit")
    labelled = plots.spaced(Ls)                                # a tick at every prefix, a label where it fits
    for a in (ax, ax_ratio):
        a.set_xscale("log")
        a.set_xticks(Ls, [f"{L:,}" if L in labelled else "" for L in Ls])
        a.minorticks_off()
        a.set_xlabel(f"cached prefix (tokens), +{times[Ls[0]]['suffix']} new")
    ax.legend()
    return finish(fig, path)


def plot_roc(side: dict, path=None):
    fig, ax = plots.figure(height=3.8)
    for case, label in (("shared", "one cache for all tenants"), ("salted", "a salt per tenant")):
        r = side[case]
        ax.plot(r["fpr"], r["tpr"], drawstyle="steps-post", label=f"{label}: AUC {r['auc']:.2f}")
    ax.plot([0, 1], [0, 1], ":", color="gray", label="chance")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", aspect="equal", xlim=(0, 1), ylim=(0, 1.01),
           title=f"Guessing another tenant's first page by time ({side['shared']['trials']} trials)")
    ax.legend(loc="lower right")
    return finish(fig, path)


def plot_costs(econ: dict, path=None):
    fig, ax = plots.figure(height=3.6)
    names = list(econ["costs"])
    x = np.arange(len(names))
    without = [econ["costs"][n]["without"] * 100 for n in names]
    cached = [econ["costs"][n]["cached"] * 100 for n in names]
    ax.bar(x - 0.2, without, 0.4, label="no cache", color="lightgray", edgecolor="black")
    ax.bar(x + 0.2, cached, 0.4, label="with the provider's cache")
    for i, (a, b) in enumerate(zip(without, cached, strict=True)):
        ax.text(i + 0.2, b, f"-{100 * (1 - b / a):.0f}%", ha="center", va="bottom")
    ax.set_xticks(x, [n.replace(", ", ",\n") for n in names])
    c = econ["chat"]
    ax.set(ylabel="input cost (US cents)", title=f"One conversation: {c['turns']} turns, "
           f"{c['system']:,}-token system prompt (synthetic)")
    ax.legend()
    return finish(fig, path)


# ---- measure and record -----------------------------------------------------------------------------------

def measure(quick_mode=None) -> dict:
    from ..peers import compare_vllm

    s = settings(quick() if quick_mode is None else quick_mode)
    smol = load("smollm2")
    vocab = smol.config.vocab_size
    workloads = {name: make(vocab, s["scale"]) for name, make in WORKLOADS.items()}
    m = dict(settings=s, manifest=smol.manifest, threads=torch.get_num_threads(),
             sweep=hit_rate_sweep(smol, workloads, s["pool_fractions"]),
             ttft=ttft(smol, s["prefixes"], s["ttft_rounds"]),
             hashing=hashing_cost(smol, s["hash_tokens"]))
    longest = m["ttft"][max(m["ttft"])]
    per_token = (longest["miss"]["median"] - longest["hit"]["median"]) / longest["cached"]
    m["economics"] = economics(smol, per_token)
    m["side_channel"] = side_channel(smol, s["trials"])
    if not s["vllm"]:
        m["vllm"] = "quick mode: vLLM takes about a minute to start; `make results` runs the comparison"
    elif not compare_vllm.available():
        m["vllm"] = "vLLM's environment is not built here (make vllm)"
    else:
        m["vllm"] = against_vllm(smol)
    return m


def record(m: dict, drawn: dict | None = None) -> dict:
    """Write section ch06 and its figures. drawn: figures already drawn (a notebook's), saved, not redrawn:
    {"hit_rate": fig, "ttft": fig, "roc": fig, "costs": fig}."""
    figs, drawn = figures_dir(), drawn or {}
    draw = {"hit_rate": lambda p: plot_hit_rate(m["sweep"], p), "ttft": lambda p: plot_ttft(m["ttft"], p),
            "roc": lambda p: plot_roc(m["side_channel"], p), "costs": lambda p: plot_costs(m["economics"], p)}
    for name, plot in draw.items():
        path = figs / f"ch06_{name}.png"
        finish(drawn[name], path) if name in drawn else plot(path)
    v = {"workloads": {}, "ttft": {}}
    for name, r in m["sweep"].items():
        key, sh = name.replace(" ", "_").replace("-", "_"), r["shape"]
        best = r["runs"][-1]
        v["workloads"][key] = {
            "requests": value(sh["requests"], "requests", note=SYNTHETIC),
            "mean_tokens": value(sh["mean_tokens"], "tokens"), "distinct_pages": value(sh["distinct_pages"], "pages"),
            "hit_rate_best": value(100 * best["hit_rate"], "%", note=f"pool of {best['num_pages']} pages"),
            "hit_rate_smallest": value(100 * r["runs"][0]["hit_rate"], "%",
                                       note=f"pool of {r['runs'][0]['num_pages']} pages"),
            "computed_best": value(best["computed_tokens"], "positions", of=sh["tokens"]),
            "by_pool": {f"p{x['num_pages']}": value(100 * x["hit_rate"], "%", computed=x["computed_tokens"],
                                                    evicted=x["evicted_pages"]) for x in r["runs"]}}
    for L, r in m["ttft"].items():
        v["ttft"][f"T{L}"] = {"hit_ms": value(r["hit"]["median"] * 1e3, "ms", iqr=r["hit"]["iqr"] * 1e3,
                                              n=r["hit"]["n"]),
                              "miss_ms": value(r["miss"]["median"] * 1e3, "ms", iqr=r["miss"]["iqr"] * 1e3),
                              "ratio": value(r["ratio"], "x"), "cached": value(r["cached"], "tokens")}
    v["ttft"]["threads"] = value(m["threads"], "threads")
    h = m["hashing"]
    v["hashing_us_per_token"] = value(h["per_token"] * 1e6, "µs", tokens=h["tokens"], note="sha256, page 16")
    e = m["economics"]
    v["economics"] = {"seconds_per_token_ms": value(e["seconds_per_token"] * 1e3, "ms",
                                                    note="SmolLM2 prefill time saved per cached token, this CPU"),
                      "lab_cached_tokens": value(e["lab_cached"], "tokens"),
                      "lab_computed_tokens": value(e["lab_computed"], "tokens"),
                      "compute_saved_s": value(e["compute_saved_s"], "s", note="per conversation, this CPU")}
    for name, c in e["costs"].items():
        key = name.split(",")[0].lower() + "_" + name.split(", ")[1].replace(" ", "_").replace("-", "_")
        source = "research/ch06/prices.md" + (", secondary sources" if PRICES[name].get("secondary") else "")
        v["economics"][key] = {"without_cents": value(c["without"] * 100, "cents"),
                               "cached_cents": value(c["cached"] * 100, "cents"),
                               "saving": value(100 * (1 - c["cached"] / c["without"]), "%",
                                               model=PRICES[name]["model"], note=source)}
    sc = m["side_channel"]
    v["side_channel"] = {case: {"auc": value(sc[case]["auc"], None, trials=sc[case]["trials"]),
                                "right_ms": value(sc[case]["right_ms"], "ms"),
                                "wrong_ms": value(sc[case]["wrong_ms"], "ms")} for case in ("shared", "salted")}
    v["side_channel"]["candidates"] = value(sc["candidates"], "prompts", page_size=sc["page_size"])
    vs = m["vllm"]
    if isinstance(vs, str):
        v["vllm"] = {"cached_identical": not_run(vs), "ttft_hit_ms": not_run(vs)}
    else:
        v["vllm"] = {"cached_identical": value(vs["cached_lab"] == vs["cached_vllm"], None,
                                               lab=vs["cached_lab"], vllm=vs["cached_vllm"],
                                               prompt_tokens=vs["prompt_tokens"]),
                     "tokens_identical": value(vs["tokens_identical"], None, max_tokens=vs["max_tokens"]),
                     "version": value(vs["vllm"], None), "lab_threads": value(vs["lab_threads"], "threads"),
                     "vllm_cores": value(len(vs["core_ids"] or []), "cores", core_ids=vs["core_ids"])}
        for side in ("lab", "vllm"):
            t = vs["ttft"][side]
            v["vllm"][side] = {"ttft_hit_ms": value(t["hit"] * 1e3, "ms", n=vs["rounds"]),
                               "ttft_miss_ms": value(t["miss"] * 1e3, "ms", n=vs["rounds"]),
                               "ratio": value(t["miss"] / t["hit"], "x"),
                               "cached": value(vs["timing_cached"][side], "tokens", of=vs["prefix"])}
    figures = {"hit_rate": {"path": figs / "ch06_hit_rate.png",
                            "caption": "Share of prompt tokens served from cache against pool size, LRU"},
               "ttft": {"path": figs / "ch06_ttft.png", "caption": "Time to first token, hit against miss"},
               "roc": {"path": figs / "ch06_roc.png",
                       "caption": "The timing side channel: ROC of guessing a tenant's first page"},
               "costs": {"path": figs / "ch06_costs.png", "caption": "Input cost of one conversation"}}
    write_section(SECTION, v, provenance(manifest=m["manifest"]), figures=figures)
    return v
