"""Chapter 8, "Serving": many requests over one pool of pages, the lab's engine against vLLM on the same cores.

- In process (`ServingEngine`, SmolLM2): throughput of continuous batching against one request after
  another; what chunked prefill does to the decoders' inter-token latency while a long prompt arrives;
  preemptions and recomputation against pool size; prefix caching on a shared system prompt; where a step's
  time goes (`lab.step_cost.profile`); a timeline of a few requests, drawn from a real run.
- Over HTTP (`lab.loadgen`): the lab's server (`python -m lab.serve`) and vLLM's, both running on the same
  two cores and sent each load in turns (both pinned with taskset; the lab with 2 torch threads, vLLM's
  OpenMP threads bound to the same cores): throughput against the number of concurrent requests, and
  latency against offered load.

Prompts are random token ids (SYNTHETIC), so a cache hit comes only from what the workload repeats on
purpose; answers are greedy and max_tokens long (vLLM with ignore_eos; the lab's server stops only at
SmolLM2's end-of-turn token, which random prompts rarely reach; `agreement` counts how often).
"""


import numpy as np
import torch
from tqdm.auto import tqdm

from .. import loadgen, step_cost
from ..bench import ratio_summary
from ..engine import ServingEngine
from ..loadgen import random_prompts
from ..models import load
from ..results import figures_dir, not_run, provenance, quick, value, write_section
from ..serve.process import lab_server
from ..step_cost import run_timed, seconds_between
from . import plots
from .plots import finish

SECTION = "ch08"
PAGE = 16
CORES = "0-1"                        # both servers on the same two cores
SYNTHETIC = "synthetic requests: random token ids (lab.experiments.ch08_serving)"


def settings(quick_mode: bool) -> dict:
    if quick_mode:  # long=768: three chunks and more, so chunking at least halves the worst gap, as in the book
        return dict(prompt=64, output=16, levels=(1, 4, 8), sequential=2, pools=(10, 14, 64), pool_requests=6,
                    long=768, chunk=256, decoders=3, shared_system=256, shared_requests=6, profile_batch=8,
                    http_levels=(1, 4), http_prompt=32, http_output=16, rates=(1.0, 4.0), rate_requests=6,
                    rounds=1,
                    max_prompt=64, max_output=16, vllm=False, timeout_s=120)
    return dict(prompt=128, output=64, levels=(1, 2, 4, 8, 16, 32, 64), sequential=4, pools=(16, 32, 64, 128, 256),
                pool_requests=16, long=1536, chunk=256,
                decoders=4, shared_system=512, shared_requests=16, profile_batch=16,
                http_levels=(1, 2, 4, 8, 16, 32, 64), http_prompt=128, http_output=64,
                rates=(0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), rate_requests=24, rounds=5, max_prompt=256,
                max_output=64,
                vllm=True, timeout_s=300)


# ---- in process --------------------------------------------------------------------------------------------

def batching(model, s) -> dict:
    """Output tokens per second when `c` requests (prompt + output of fixed length) arrive at once: the
    engine batching them, against the same engine serving them one after another."""
    V = model.config.vocab_size
    out = {"batched": {}, "sequential": None}
    need = -(-(s["prompt"] + s["output"]) // PAGE)
    for c in tqdm(s["levels"], desc="batching", leave=False):
        eng = ServingEngine(model, (need + 1) * c, PAGE, 256, prefix_caching=False)  # room for all at once
        run_timed(eng, random_prompts(1, s["prompt"], 999, V), 2)                       # warm-up
        r = run_timed(eng, random_prompts(c, s["prompt"], c, V), s["output"])
        sizes = eng.stats["batch_sizes"][-len(r["step_s"]):]
        out["batched"][c] = dict(tok_s=c * s["output"] / r["seconds"], seconds=r["seconds"],
                                 steps=len(r["step_s"]), mean_batch=float(np.mean(sizes)))
    eng = ServingEngine(model, need, PAGE, 256, prefix_caching=False)
    ps, t = random_prompts(s["sequential"], s["prompt"], 1000, V), 0.0
    for p in ps:
        t += run_timed(eng, [p], s["output"])["seconds"]
    out["sequential"] = dict(tok_s=len(ps) * s["output"] / t, seconds=t, requests=len(ps))
    return out


def chunked_prefill(model, s) -> dict:
    """`decoders` requests decoding when a `long`-token prompt arrives: with chunked prefill (`chunk` tokens
    a step) and without (the whole prompt in one step). The decoders' inter-token latency is the time of each
    step they get a token in; the long prompt's TTFT runs from its arrival to its first token."""
    V = model.config.vocab_size
    out = {}
    short, n_out = 32, 10 + 2 * -(-s["long"] // s["chunk"])           # decoding until the prompt is done
    for name, budget in (("chunked", s["chunk"]), ("whole", s["long"] + s["decoders"])):
        eng = ServingEngine(model, 512, PAGE, budget, prefix_caching=False)
        run_timed(eng, random_prompts(1, short, 998, V), 2)                             # warm-up
        ps = random_prompts(s["decoders"], short, 20, V) + random_prompts(1, s["long"], 21, V)
        r = run_timed(eng, ps, [n_out] * s["decoders"] + [4], arrivals=[0] * s["decoders"] + [2])
        long = r["timeline"][-1]
        gaps = [t for t, n in zip(r["step_s"], eng.stats["batch_sizes"][-len(r["step_s"]):], strict=True) if n]
        while_long = r["step_s"][long["arrived"] - r["start"]:long["first_token"] - r["start"] + 1]
        out[name] = dict(max_batch_tokens=budget, itl_max_s=max(while_long), itl_median_s=float(np.median(gaps)),
                         ttft_long_s=seconds_between(r, long["arrived"], long["first_token"]),
                         long_chunks=len(long["chunks"]), step_s=r["step_s"])
    return out


def preemption(model, s) -> dict:
    """`pool_requests` requests of prompt + output tokens at once, on pools of `pools` pages (a request needs
    `need` pages at its longest): preemptions, positions recomputed, steps and seconds; tokens against the
    largest pool's."""
    V = model.config.vocab_size
    n, need = s["pool_requests"], -(-(s["prompt"] + s["output"] - 1) // PAGE)
    ps, out = random_prompts(n, s["prompt"], 30, V), {}
    for pages in tqdm(sorted(s["pools"], reverse=True), desc="pool sizes", leave=False):
        if pages < need:
            continue
        eng = ServingEngine(model, pages, PAGE, 256, prefix_caching=False)
        r = run_timed(eng, ps, s["output"])
        out[pages] = dict(preemptions=eng.stats["preemptions"], computed=eng.stats["computed_tokens"],
                          ideal=n * (s["prompt"] + s["output"] - 1), steps=eng.stats["steps"], seconds=r["seconds"],
                          outputs=r["outputs"])
    biggest = out[max(out)]["outputs"]
    for r in out.values():
        r["identical"] = r.pop("outputs") == biggest
    return dict(runs=out, need=need, requests=n, all_pages=n * need)


def prefix_sharing(model, s) -> dict:
    """`shared_requests` requests with one `shared_system`-token system prompt and 32 tokens of their own,
    arriving one every two steps, with prefix caching and without: positions computed and taken from cache,
    seconds, median TTFT (seconds), tokens identical."""
    V = model.config.vocab_size
    system = random_prompts(1, s["shared_system"], 40, V)[0]
    ps = [system + p for p in random_prompts(s["shared_requests"], 32, 41, V)]
    arrivals = [2 * i for i in range(len(ps))]
    out = {}
    for on in (True, False):
        eng = ServingEngine(model, 1024, PAGE, 256, prefix_caching=on)
        r = run_timed(eng, ps, 16, arrivals)
        ttfts = [seconds_between(r, x["arrived"], x["first_token"]) for x in r["timeline"]]
        out["cached" if on else "uncached"] = dict(
            computed=eng.stats["computed_tokens"], cached=eng.stats["cached_tokens"], seconds=r["seconds"],
            ttft_median_s=float(np.median(ttfts)), outputs=r["outputs"])
    out["identical"] = out["cached"].pop("outputs") == out["uncached"].pop("outputs")
    out["prompt_tokens"] = sum(map(len, ps))
    return out


def timeline_run(model) -> dict:
    """Five requests on a pool of 13 pages, 64 tokens a step: chunked prefill, decoding side by side, and the
    youngest request preempted while the older ones grow. The engine's timeline, and its per-step batch sizes."""
    eng = ServingEngine(model, 13, PAGE, 64, prefix_caching=False)
    ps = [random_prompts(1, n, 60 + i, model.config.vocab_size)[0] for i, n in enumerate((150, 30, 40, 120, 20))]
    r = run_timed(eng, ps, [10, 40, 30, 12, 20], arrivals=[0, 0, 3, 6, 8])
    return dict(timeline=r["timeline"], steps=eng.stats["steps"], preemptions=eng.stats["preemptions"],
                batch_tokens=eng.stats["batch_tokens"], page_size=PAGE, num_pages=13, max_batch_tokens=64)


# ---- over HTTP: the lab's server and vLLM's on the same cores ------------------------------------------------

def compared(s) -> tuple:
    """The loads the servers are compared at, several rounds each: 16 and 64 requests in flight (quick mode:
    its largest level)."""
    return tuple(c for c in (16, 64) if c in s["http_levels"]) or (max(s["http_levels"]),)


def http(s) -> dict:
    """The lab's server and vLLM's, both on the same cores, sent the same loads in turns
    (`loadgen.compare_servers`): c requests of fixed length in flight, at the `compared` levels `rounds`
    times, there also both servers in bfloat16 (full mode), the lab's server with its engine stepped in
    the server's own process (`lab_one_process`) and with its engine's threads sleeping between operators
    (`lab_passive`, `--wait-policy passive`); one request at a time (the lab's sequential loop); each
    offered rate (Poisson arrivals, ShareGPT-shaped lengths), in float32. The lab's server is started as
    the README starts it: its own environment, torch's thread count, its default wait policy."""
    lab = lambda **kw: (lab_server(cores=CORES, num_pages=1024, **kw), loadgen.LAB_FIELDS)
    servers = {"lab": lab(), "lab_one_process": lab(one_process=True), "lab_passive": lab(wait_policy="passive")}
    out = {}
    if not s["vllm"]:
        why = "quick mode: vLLM takes about a minute to start; `make results` runs the comparison"
        out = dict.fromkeys(("vllm", "lab_bf16", "vllm_bf16"), why)
    elif not (loadgen.VLLM_BIN / "python").exists():
        out = dict.fromkeys(("vllm", "lab_bf16", "vllm_bf16"), "vLLM's environment is not built here (make vllm)")
    else:
        servers |= {"vllm": (loadgen.vllm_server(cores=CORES), loadgen.VLLM_FIELDS), "lab_bf16": lab(dtype="bfloat16"),
                    "vllm_bf16": (loadgen.vllm_server(cores=CORES, dtype="bfloat16"), loadgen.VLLM_FIELDS)}
    out |= loadgen.compare_servers(servers, s["http_levels"], s["http_prompt"], s["http_output"], s["rates"],
                                   s["rate_requests"], s["max_prompt"], s["max_output"], s["sequential"],
                                   rounds=s["rounds"], compare_at=compared(s), timeout_s=s["timeout_s"],
                                   compare_only=("lab_one_process", "lab_passive", "lab_bf16", "vllm_bf16"))
    if "vllm" in servers:
        out["agreement"] = agreement(out, s["http_levels"])
    return out


# ---- figures ------------------------------------------------------------------------------------------------

def plot_timeline(t: dict, path=None):
    fig, ax = plots.figure(height=3.0)
    end = t["steps"]
    for y, r in enumerate(t["timeline"]):
        done = r["finished"] if r["finished"] is not None else end
        ax.broken_barh([(r["arrived"], done + 1 - r["arrived"])], (y - 0.3, 0.6), color="0.9")   # in the system
        chunks = [s for s, _ in r["chunks"]]
        ax.broken_barh([(s, 1) for s in chunks], (y - 0.3, 0.6), color="tab:orange")
        ax.broken_barh(step_cost.decoding_spans(r, end), (y - 0.3, 0.6), color="tab:blue")
        for p in r["preempted"]:
            ax.plot(p + 0.5, y, "x", color="black", markersize=8, markeredgewidth=2)
    ax.set_yticks(range(len(t["timeline"])), [f"req {r['id']}: {r['prompt_tokens']}+{r['output_tokens']}"
                                              for r in t["timeline"]])
    ax.invert_yaxis()
    ax.set(xlabel=f"engine step ({t['num_pages']} pages of {t['page_size']}, {t['max_batch_tokens']} tokens "
                  "a step)", xlim=(0, end + 1))
    handles = [plots.plt.Rectangle((0, 0), 1, 1, color=c) for c in ("0.9", "tab:orange", "tab:blue")]
    handles.append(plots.plt.Line2D([], [], color="black", marker="x", linestyle="none"))
    ax.legend(handles, ["waiting", "prefill chunk", "decoding", "preempted"], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), ncols=4, frameon=False)
    return finish(fig, path)


def plot_throughput(b: dict, h: dict | None, path=None):
    fig, ax = plots.figure(height=3.6)
    cs = sorted(b["batched"])
    ax.plot(cs, [b["batched"][c]["tok_s"] for c in cs], "o-", label="lab engine, in process")
    ax.axhline(b["sequential"]["tok_s"], ls=":", color="gray", label="lab, one request at a time")
    if h:
        for side, style in (("lab", "s--"), ("vllm", "^-")):
            if isinstance(h.get(side), dict):
                cc = sorted(h[side]["concurrency"])
                ax.plot(cc, [h[side]["concurrency"][c]["throughput_tok_s"] for c in cc], style,
                        label=f"{'lab server' if side == 'lab' else 'vLLM server'} (HTTP)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.minorticks_off()
    ax.set(xlabel="requests in flight", ylabel="output tokens / s", ylim=(0, None),
           title="SmolLM2 on two CPU cores")
    ax.legend()
    return finish(fig, path)


def plot_latency(h: dict, path=None):
    fig, (a_ttft, a_itl) = plots.figure(ncols=2, height=3.6)
    for side, style in (("lab", "s-"), ("vllm", "^-")):
        if not isinstance(h.get(side), dict):
            continue
        rates = sorted(h[side]["rates"])
        for key, ax in (("ttft", a_ttft), ("itl", a_itl)):
            for q, ls in (("median", style), ("p99", style[0] + ":")):
                ys = [h[side]["rates"][r][f"{key}_{q}_s"] for r in rates]
                ax.plot(rates, [y * 1e3 if y is not None else np.nan for y in ys], ls,
                        label=f"{'lab' if side == 'lab' else 'vLLM'} {q}",
                        color="tab:blue" if side == "lab" else "tab:red")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for ax, what in ((a_ttft, "time to first token"), (a_itl, "inter-token latency")):
        ax.set(xlabel="offered load (requests / s)", ylabel=f"{what} (ms)", yscale="log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    fig.legend(*a_ttft.get_legend_handles_labels(), loc="lower center", ncols=4, frameon=False)
    return finish(fig, path, rect=(0, 0.08, 1, 1))


# ---- measure and record -------------------------------------------------------------------------------------

def measure(quick_mode=None, http_runs=True) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    smol = load("smollm2")
    m = dict(settings=s, manifest=smol.manifest, threads=torch.get_num_threads())
    m["batching"] = batching(smol, s)
    m["chunked"] = chunked_prefill(smol, s)
    m["preemption"] = preemption(smol, s)
    m["prefix"] = prefix_sharing(smol, s)
    m["profile"] = step_cost.profile(smol, s["profile_batch"], s["prompt"], fast=False)   # the reference step's parts
    m["step_costs"] = step_cost.step_costs(smol, s["profile_batch"], s["prompt"])
    m["timeline"] = timeline_run(smol)
    m["http"] = http(s) if http_runs else None
    return m


def values(m: dict) -> dict:
    """The section's values, from every part of the measurements that m holds: a notebook sets each part's
    verdicts beside the book's as soon as it has measured that part (lab.book.verdicts); record() writes them all."""
    s = m["settings"]
    shape = f"{s['prompt']}-token prompts, {s['output']} tokens out"
    v = {"threads": value(m["threads"], "threads"),
         "shape": {"prompt": value(s["prompt"], "tokens"), "output": value(s["output"], "tokens"),
                   "http_prompt": value(s["http_prompt"], "tokens"), "http_output": value(s["http_output"], "tokens")}}
    if "batching" in m:
        b = m["batching"]
        v["batching"] = {f"c{c}": value(r["tok_s"], "tok/s", seconds=r["seconds"], steps=r["steps"],
                                        mean_batch=r["mean_batch"], note=shape) for c, r in b["batched"].items()}
        v["batching"]["sequential"] = value(b["sequential"]["tok_s"], "tok/s", requests=b["sequential"]["requests"],
                                            note=shape)
        top = max(b["batched"])
        v["batching"]["gain"] = value(b["batched"][top]["tok_s"] / b["sequential"]["tok_s"], "x",
                                      note=f"{top} requests at once against one at a time")
    if "chunked" in m:
        c = m["chunked"]
        v["chunked"] = {k: {"itl_max_ms": value(r["itl_max_s"] * 1e3, "ms", note="worst decode step while the "
                                                f"{s['long']}-token prompt was prefilled"),
                            "itl_median_ms": value(r["itl_median_s"] * 1e3, "ms"),
                            "ttft_long_ms": value(r["ttft_long_s"] * 1e3, "ms", chunks=r["long_chunks"]),
                            "max_batch_tokens": value(r["max_batch_tokens"], "tokens")} for k, r in c.items()}
        v["chunked"] |= {"stall_ratio": value(c["whole"]["itl_max_s"] / c["chunked"]["itl_max_s"], "x"),
                         "long": value(s["long"], "tokens"), "decoders": value(s["decoders"], "requests")}
    if "preemption" in m:
        p = m["preemption"]
        v["preemption"] = {f"p{k}": {"preemptions": value(r["preemptions"], "preemptions"),
                                     "recomputed": value(r["computed"] - r["ideal"], "positions", ideal=r["ideal"]),
                                     "seconds": value(r["seconds"], "s", steps=r["steps"]),
                                     "identical": value(r["identical"], None)} for k, r in p["runs"].items()}
        v["preemption"]["need"] = value(p["need"], "pages", note="one request at its longest")
        v["preemption"]["requests"] = value(p["requests"], "requests")
        v["preemption"]["all_pages"] = value(p["all_pages"], "pages", note="every request at its longest, at once")
    if "prefix" in m:
        x = m["prefix"]
        v["prefix"] = {k: {"computed": value(x[k]["computed"], "positions", of=x["prompt_tokens"]),
                           "cached": value(x[k]["cached"], "positions"),
                           "seconds": value(x[k]["seconds"], "s"),
                           "ttft_median_ms": value(x[k]["ttft_median_s"] * 1e3, "ms")} for k in ("cached", "uncached")}
        v["prefix"]["speedup"] = value(x["uncached"]["seconds"] / x["cached"]["seconds"], "x",
                                       note=f"{s['shared_requests']} requests, {s['shared_system']}-token system "
                                            "prompt")
        v["prefix"] |= {"identical": value(x["identical"], None), "requests": value(s["shared_requests"], "requests"),
                        "system": value(s["shared_system"], "tokens")}
    if "profile" in m:
        v["profile"] = step_cost.profile_values(m["profile"])
    if "step_costs" in m:
        v["step_costs"] = step_cost.step_costs_values(m["step_costs"])
    if "timeline" in m:
        t = m["timeline"]
        v["timeline"] = {"steps": value(t["steps"], "steps"), "preemptions": value(t["preemptions"], "preemptions"),
                         "requests": step_cost.timeline_values(t["timeline"])}
    if "http" in m:
        v["http"] = http_values(m["http"], s)
    return v


def http_values(h: dict | None, s: dict) -> dict:
    """http()'s output as results values (NOT_RUN where a server did not run, or where h is None)."""
    if h is None:
        return {"lab": not_run("run without the servers")}
    v = {}
    for side in ("lab", "vllm", "lab_one_process", "lab_passive", "lab_bf16", "vllm_bf16"):
        r = h.get(side, "not run")
        v[side] = {"throughput": not_run(r, "tok/s")} if isinstance(r, str) else server_values(r)
    c16 = compared(s)[0]
    v["rate_requests"] = value(s["rate_requests"], "requests", note="at each offered rate")
    v["rounds"] = value(s["rounds"], "runs", note="of each server at 16 and 64 requests in flight")
    if isinstance(h["vllm"], dict):
        v["ratio"] = ratio(h, "lab", "vllm", c16, f"lab server over vLLM's, {c16} requests in flight, same "
                                   "two cores, float32")
        v["ratios"] = ratios(h, {"float32": ("lab", "vllm"), "bfloat16": ("lab_bf16", "vllm_bf16")},
                                     compared(s))
        v |= agreement_values(h["agreement"])
    if isinstance(h.get("lab_one_process"), dict):
        v["process_gain"] = ratio(h, "lab", "lab_one_process", c16, "engine in its own process over in the "
                                          f"server's, {c16} requests in flight")
    if isinstance(h.get("lab_passive"), dict):
        v["wait_policy_gain"] = {f"c{c}": ratio(h, "lab", "lab_passive", c, "the server's default wait policy "
                                                f"(OpenMP's, spin) over --wait-policy passive, {c} requests in flight")
                                 for c in compared(s)}
    return v


def record(m: dict, drawn: dict | None = None) -> dict:
    """Write section ch08 and its figures (drawn: a notebook's figures, saved as they are)."""
    figs, drawn = figures_dir(), drawn or {}
    draw = {"timeline": lambda p: plot_timeline(m["timeline"], p),
            "throughput": lambda p: plot_throughput(m["batching"], m["http"], p)}
    if m["http"]:
        draw["latency"] = lambda p: plot_latency(m["http"], p)
    for name, plot in draw.items():
        path = figs / f"ch08_{name}.png"
        finish(drawn[name], path) if name in drawn else plot(path)
    v, h = values(m), m["http"]
    figures = {"timeline": {"path": figs / "ch08_timeline.png",
                            "caption": "Requests admitted, prefilled in chunks, decoded and preempted, step by step"},
               "throughput": {"path": figs / "ch08_throughput.png",
                              "caption": "Output tokens per second against requests in flight"}}
    if h:
        figures["latency"] = {"path": figs / "ch08_latency.png",
                              "caption": "Time to first token and inter-token latency against offered load"}
    write_section(SECTION, v, provenance(manifest=m["manifest"], cores=CORES, note=SYNTHETIC), figures=figures)
    return v


# ---- the two servers' answers, and as results values ----


def agreement(h, levels) -> dict:
    """compare_servers' "lab" and "vllm" answers to the same requests (round 0 of every level): identical;
    one a prefix of the other (the lab's server stops at SmolLM2's end-of-turn token, vLLM was told to ignore
    it); shorter."""
    pairs = [pair for c in levels for pair in zip(h["lab"]["concurrency"][c]["tokens"],
                                                  h["vllm"]["concurrency"][c]["tokens"], strict=True)]
    return dict(identical=sum(a == b and len(a) > 0 for a, b in pairs), requests=len(pairs),
                prefix=sum(len(a) > 0 and a == b[:len(a)] for a, b in pairs),
                lab_stopped=sum(len(a) < len(b) for a, b in pairs),
                first_token=sum(a[:1] == b[:1] and len(a) > 0 for a, b in pairs))


def agreement_values(a: dict) -> dict:
    """`agreement` as results values: the share of identical answers, of answers equal to vLLM's or its start,
    and how often the lab's server stopped at the end-of-turn token."""
    return {"agreement": value(a["identical"] / a["requests"], None, identical=a["identical"],
                               requests=a["requests"], first_token=a["first_token"]),
            "agreement_prefix": value(a["prefix"] / a["requests"], None,
                                      note="the lab's answer equal to vLLM's, or its start"),
            "lab_stopped": value(a["lab_stopped"], "requests", of=a["requests"],
                                 note="the lab's server stopped at the end-of-turn token")}


def ratio(out: dict, a: str, b: str, c: int, note: str = "") -> dict:
    """Server a's throughput over server b's at c requests in flight, as a results value: the median over
    rounds of each round's ratio (a round sends the load to both, one after the other, so a slow spell of
    the machine falls on both sides of a ratio), with every round's ratio, the lowest and highest (the spread
    a reader should allow) and the quartiles, as chapter 3's timings are compared (`lab.bench.ratio_summary`)."""
    x, y = out[a]["concurrency"][c], out[b]["concurrency"][c]
    kept = [(p, q) for p, q in zip(x["rounds"], y["rounds"], strict=True) if q]   # b served nothing: left out
    return rounds_ratio([p for p, _ in kept], [q for _, q in kept], note or f"{a} over {b}, {c} requests in flight")


def rounds_ratio(num: list, den: list, note: str) -> dict:
    """num[i] / den[i] for each round i as a results value: their median, every round's ratio, the lowest and
    highest and the quartiles (`lab.bench.ratio_summary`)."""
    r = ratio_summary(num, den)
    return value(r["median"], "x", rounds=[p / q for p, q in zip(num, den, strict=True)], low=r["min"],
                 high=r["max"], q1=r["q1"], q3=r["q3"], note=note)


def ratios(out: dict, pairs: dict, levels) -> dict:
    """{name: {"c16": {"ratio", "low", "high"}}}: for each name's (server a, server b) of `pairs` and each
    level, `ratio` and, as values of their own, the lowest and highest of its rounds' ratios."""
    def spread(r):
        return {"ratio": r, "low": value(r["low"], "x"), "high": value(r["high"], "x")}
    return {name: {f"c{c}": spread(ratio(out, a, b, c)) for c in levels} for name, (a, b) in pairs.items()}


def server_values(r: dict) -> dict:
    """One server's `compare_servers` results as results.json values: throughput, median TTFT and ITL at
    each level in flight ("c16"), the same and the tails and goodput at each offered rate ("r0_5"), and the
    sequential loop's throughput where it ran."""
    ms = lambda x: value(x * 1e3, "ms") if x is not None else not_run("no request completed", "ms")
    out = {"concurrency": {f"c{c}": {"throughput": value(x["throughput_tok_s"] or 0.0, "tok/s", failed=x["failed"],
                                                         rounds=x["rounds"]),
                                     "ttft_median_ms": ms(x["ttft_median_s"]), "itl_median_ms": ms(x["itl_median_s"])}
                           for c, x in r["concurrency"].items()}}
    if r["rates"]:                                              # a server sent only the compared level has none
        out["rates"] = {f"r{rate:g}".replace(".", "_"): {
            "throughput": value(x["throughput_tok_s"] or 0.0, "tok/s", offered=rate, completed=x["completed"],
                                requests=x["requests"]),
            "goodput": value(x["goodput"] or 0.0, "req/s", slo_ttft_s=x["slo_ttft_s"], slo_itl_s=x["slo_itl_s"]),
            "ttft_median_ms": ms(x["ttft_median_s"]), "ttft_p99_ms": ms(x["ttft_p99_s"]),
            "itl_median_ms": ms(x["itl_median_s"]), "itl_p99_ms": ms(x["itl_p99_s"])} for rate, x in r["rates"].items()}
    if "sequential" in r:
        out["sequential"] = value(r["sequential"]["throughput_tok_s"], "tok/s")
    return out
