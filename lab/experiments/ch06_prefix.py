"""Chapter 6, "Prefix caching": how much of a workload the pages already hold, what a hit saves in time to
first token, what naming pages costs, what a shared cache tells another tenant, what caching saves in money,
and the lab against vLLM on the same requests (`lab.peers.vllm_agreement`).

The workloads are SYNTHETIC (`lab.workloads`): random token ids in the shapes of real traffic; real traffic,
Mooncake's conversation trace at 1/32 scale, is lab.experiments.mooncake's (section "mooncake"). Hit rates depend
only on which tokens repeat, so the sweeps run the backend's own bookkeeping without the model
(`lab.workloads.hit_rate`). Times are SmolLM2 on this CPU.
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
from ..metrics import roc
from ..models import load
from ..peers.vllm_agreement import against_vllm
from ..results import figures_dir, not_run, provenance, quick, value, write_section
from ..workloads import WORKLOADS, conversation, hit_rate, hit_rate_sweep
from . import plots
from .plots import finish

SECTION = "ch06"
PAGE = 16                       # the lab's page size; the comparison with vLLM uses 32 (its CPU backend's)
SUFFIX = 16                     # new tokens after the cached prefix, in the time-to-first-token measurement
SYNTHETIC = "synthetic workload: random token ids in the shape of real traffic (lab.workloads)"


def settings(quick_mode: bool) -> dict:
    if quick_mode:
        return dict(scale=0.5, pool_fractions=(0.05, 0.1, 0.2, 0.4, 0.7, 1.0), prefixes=(64, 256, 1024),
                    ttft_rounds=3, trials=80, hash_tokens=4096, vllm=False)
    return dict(scale=1.0, pool_fractions=(0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.55, 0.7, 0.85, 1.0),
                prefixes=(32, 64, 128, 256, 512, 1024, 1536), ttft_rounds=15, trials=400, hash_tokens=65536,
                vllm=True)


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
    requests = conversation(model.config.vocab_size, chat["system"], chat["turns"], chat["user"], chat["reply"])
    lab = hit_rate(model, requests, -(-len(requests[-1]) // page_size) + 1, page_size)
    return dict(costs={name: conversation_cost(p, chat) for name, p in PRICES.items()}, chat=chat,
                lab_cached=lab["cached_tokens"], lab_computed=lab["computed_tokens"],
                compute_saved_s=lab["cached_tokens"] * seconds_per_token, seconds_per_token=seconds_per_token)


# ---- figures ----------------------------------------------------------------------------------------------

def plot_hit_rate(sweep: dict, path=None):
    """The synthetic workloads' hit rate against pool size (the real trace's: mooncake.plot_capacity)."""
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


def values(m: dict) -> dict:
    """The section's values, from every part of the measurements that m holds: a notebook sets each part's
    verdicts beside the book's as soon as it has measured that part (lab.book.verdicts); record() writes them all."""
    v = {k: {} for k, part in (("workloads", "sweep"), ("ttft", "ttft")) if part in m}
    for name, r in m.get("sweep", {}).items():
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
    for L, r in m.get("ttft", {}).items():
        v["ttft"][f"T{L}"] = {"hit_ms": value(r["hit"]["median"] * 1e3, "ms", iqr=r["hit"]["iqr"] * 1e3,
                                              n=r["hit"]["n"]),
                              "miss_ms": value(r["miss"]["median"] * 1e3, "ms", iqr=r["miss"]["iqr"] * 1e3),
                              "ratio": value(r["ratio"], "x"), "cached": value(r["cached"], "tokens")}
    if "ttft" in m:
        v["ttft"]["threads"] = value(m["threads"], "threads")
    if "hashing" in m:
        h = m["hashing"]
        v["hashing_us_per_token"] = value(h["per_token"] * 1e6, "µs", tokens=h["tokens"], note="sha256, page 16")
    if "economics" in m:
        v["economics"] = economics_values(m["economics"])
    if "side_channel" in m:
        sc = m["side_channel"]
        v["side_channel"] = {case: {"auc": value(sc[case]["auc"], None, trials=sc[case]["trials"]),
                                    "right_ms": value(sc[case]["right_ms"], "ms"),
                                    "wrong_ms": value(sc[case]["wrong_ms"], "ms")} for case in ("shared", "salted")}
        v["side_channel"]["candidates"] = value(sc["candidates"], "prompts", page_size=sc["page_size"])
    if "vllm" in m:
        v["vllm"] = vllm_values(m["vllm"])
    return v


def economics_values(e: dict) -> dict:
    """economics()'s output as results values."""
    v = {"seconds_per_token_ms": value(e["seconds_per_token"] * 1e3, "ms",
                                       note="SmolLM2 prefill time saved per cached token, this CPU"),
         "lab_cached_tokens": value(e["lab_cached"], "tokens"),
         "lab_computed_tokens": value(e["lab_computed"], "tokens"),
         "compute_saved_s": value(e["compute_saved_s"], "s", note="per conversation, this CPU")}
    for name, c in e["costs"].items():
        key = name.split(",")[0].lower() + "_" + name.split(", ")[1].replace(" ", "_").replace("-", "_")
        source = "research/ch06/prices.md" + (", secondary sources" if PRICES[name].get("secondary") else "")
        v[key] = {"without_cents": value(c["without"] * 100, "cents"),
                  "cached_cents": value(c["cached"] * 100, "cents"),
                  "saving": value(100 * (1 - c["cached"] / c["without"]), "%", model=PRICES[name]["model"],
                                  note=source)}
    return v


def vllm_values(vs) -> dict:
    """against_vllm()'s output as results values; NOT_RUN with the reason where `vs` is a string."""
    if isinstance(vs, str):
        return {"cached_identical": not_run(vs), "ttft_hit_ms": not_run(vs)}
    v = {"cached_identical": value(vs["cached_lab"] == vs["cached_vllm"], None, lab=vs["cached_lab"],
                                   vllm=vs["cached_vllm"], prompt_tokens=vs["prompt_tokens"]),
         "tokens_identical": value(vs["tokens_identical"], None, max_tokens=vs["max_tokens"]),
         "version": value(vs["vllm"], None), "lab_threads": value(vs["lab_threads"], "threads"),
         "vllm_cores": value(len(vs["core_ids"] or []), "cores", core_ids=vs["core_ids"])}
    for side in ("lab", "vllm"):
        t = vs["ttft"][side]
        v[side] = {"ttft_hit_ms": value(t["hit"] * 1e3, "ms", n=vs["rounds"]),
                   "ttft_miss_ms": value(t["miss"] * 1e3, "ms", n=vs["rounds"]),
                   "ratio": value(t["miss"] / t["hit"], "x"),
                   "cached": value(vs["timing_cached"][side], "tokens", of=vs["prefix"])}
    return v


def record(m: dict, drawn: dict | None = None) -> dict:
    """Write section ch06 and its figures. drawn: figures already drawn (a notebook's), saved, not redrawn:
    {"hit_rate": fig, "ttft": fig, "roc": fig, "costs": fig}."""
    figs, drawn = figures_dir(), drawn or {}
    draw = {"hit_rate": lambda p: plot_hit_rate(m["sweep"], p),
            "ttft": lambda p: plot_ttft(m["ttft"], p),
            "roc": lambda p: plot_roc(m["side_channel"], p), "costs": lambda p: plot_costs(m["economics"], p)}
    for name, plot in draw.items():
        path = figs / f"ch06_{name}.png"
        finish(drawn[name], path) if name in drawn else plot(path)
    v = values(m)
    figures = {"hit_rate": {"path": figs / "ch06_hit_rate.png",
                            "caption": "Share of prompt tokens served from cache against pool size, LRU; "
                                       "synthetic workloads"},
               "ttft": {"path": figs / "ch06_ttft.png", "caption": "Time to first token, hit against miss"},
               "roc": {"path": figs / "ch06_roc.png",
                       "caption": "The timing side channel: ROC of guessing a tenant's first page"},
               "costs": {"path": figs / "ch06_costs.png", "caption": "Input cost of one conversation"}}
    write_section(SECTION, v, provenance(manifest=m["manifest"]), figures=figures)
    return v
