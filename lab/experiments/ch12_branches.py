"""Chapter 12, "Many answers from one prompt": parallel sampling, beam search and shared-prefix attention.

Measured (SmolLM2 in float32 on this CPU unless a part says otherwise):
- memory: pages held by n = 2, 4, 8, 16 sampled answers forked from one prefill against n requests of their
  own, on the synthetic ShareGPT and Alpaca lengths of chapter 5 (bookkeeping only: `lab.branches`), and by
  beam search with 4 and 8 beams (the real search: `lab.engine.beam_search`) against as many sequences
  that share nothing;
- beam search beside transformers' `generate(num_beams=...)`: the same sequences, the time per step, and the
  bytes each copies per step (copy on write of a partly filled page, against reordering every cache);
- the engine end to end: n answers to each prompt as one request (one prefill, forked) against n requests
  (each prefilled), throughput and time to first token; over HTTP, the lab's server and vLLM's with the same
  requests, and the greedy answers of both compared (full mode: vLLM takes a minute to start);
- attention: decode attention over a shared prefix of 1K to 16K positions for 1 to 16 branches, the cascade
  (the prefix read once for every branch) against the paged kernel (`lab.cascade_bench`).
"""

import statistics
import time

import torch
from tqdm.auto import tqdm

from .. import loadgen
from ..branches import sampling_pages
from ..cache.block_manager import pages_for
from ..data import REQUEST_DATASETS, synthetic_lengths
from ..engine import ServingEngine, beam_search
from ..models import load
from ..results import not_run, provenance, quick, value, write_section
from ..serve.process import lab_server

SECTION = "ch12"
PAGE = 16
CORES = "0-1"
SYNTHETIC = "synthetic lengths: chapter 5's log-normal ShareGPT and Alpaca shapes (lab.data.synthetic_lengths)"


def settings(quick_mode: bool) -> dict:
    if quick_mode:
        return dict(ns=(2, 4, 8, 16), sampling_requests=100, beams=(4,), beam_requests=1, beam_cap=24,
                    tf_prompt=64, tf_new=8, tf_rounds=1, engine_prompts=2, engine_prompt=128, engine_new=8,
                    engine_n=8, temperature=0.8, vllm=False, http_prompts=2, http_prompt=128, engine_rounds=1,
                    branches=(1, 16), shared=(1024, 4096), dtypes=("float32",), rounds=5)
    return dict(ns=(2, 4, 8, 16), sampling_requests=1000, beams=(4, 8), beam_requests=6, beam_cap=256,
                tf_prompt=512, tf_new=32, tf_rounds=3, engine_prompts=4, engine_prompt=1536, engine_new=64,
                engine_n=8, temperature=0.8, vllm=True, http_prompts=4, http_prompt=512, engine_rounds=3,
                branches=(1, 4, 16), shared=(1024, 4096, 16384), dtypes=("float32", "bfloat16"), rounds=15)


# ---- memory ----------------------------------------------------------------------------------------------------

def sampling_memory(s: dict) -> dict:
    """dataset -> n -> the page-steps of n answers per prompt, forked and apart, summed over the requests (each
    request's prompt and every answer's length drawn from the dataset's shape)."""
    out = {}
    for d in REQUEST_DATASETS:
        inputs, _ = synthetic_lengths(d, s["sampling_requests"], seed=1)
        _, outputs = synthetic_lengths(d, s["sampling_requests"] * max(s["ns"]), seed=2)
        out[d] = {}
        for n in s["ns"]:
            runs = [sampling_pages(int(p), [int(x) for x in outputs[i * n:(i + 1) * n]], PAGE)
                    for i, p in enumerate(inputs)]
            shared, apart = sum(r["shared"] for r in runs), sum(r["independent"] for r in runs)
            out[d][n] = dict(shared=shared, independent=apart, saving=1 - shared / apart,
                             copies=sum(r["copies"] for r in runs))
    return out


def beam_memory(model, s: dict) -> dict:
    """dataset -> beams -> page-steps of beam search against `beams` sequences that share nothing, over
    `beam_requests` prompts of random ids with the dataset's lengths (outputs capped at beam_cap)."""
    out, g = {}, torch.Generator().manual_seed(5)
    for d in REQUEST_DATASETS:
        inputs, outputs = synthetic_lengths(d, s["beam_requests"], seed=3)
        out[d] = {}
        for k in s["beams"]:
            held = apart = steps = 0
            for p, o in tqdm(list(zip(inputs, outputs, strict=True)), desc=f"beams {d} {k}", leave=False):
                ids = torch.randint(0, model.config.vocab_size, (int(p),), generator=g).tolist()
                r = beam_search(model, ids, k, min(int(o), s["beam_cap"]), page_size=PAGE)
                held += sum(r.stats["held_pages"])
                apart += sum(k * pages_for(int(p) + t, PAGE) for t in range(1, len(r.stats["held_pages"]) + 1))
                steps += len(r.stats["held_pages"])
            out[d][k] = dict(shared=held, independent=apart, saving=1 - held / apart, steps=steps)
    return out


# ---- beam search beside transformers -------------------------------------------------------------------------

def beams_vs_transformers(model, s: dict, k: int = 4) -> dict:
    """The same prompt through beam_search and transformers' generate(num_beams=k): sequences equal, median
    seconds over `tf_rounds` runs each (interleaved), bytes copied per step."""
    from ..models.hf import to_transformers

    hf = to_transformers(model)
    ids = torch.randint(0, model.config.vocab_size, (s["tf_prompt"],), generator=torch.Generator().manual_seed(7))
    T, times = s["tf_new"], {"lab": [], "transformers": []}
    for _ in range(s["tf_rounds"]):
        t0 = time.perf_counter()
        ours = beam_search(model, ids.tolist(), k, T, page_size=PAGE)
        times["lab"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            theirs = hf.generate(ids[None], num_beams=k, do_sample=False, max_new_tokens=T, min_new_tokens=T,
                                 num_return_sequences=k, early_stopping=False, eos_token_id=None, pad_token_id=0)
        times["transformers"].append(time.perf_counter() - t0)
    same = [list(x) for x in theirs[:, len(ids):].tolist()] == ours.sequences
    steps = len(ours.stats["copied_bytes"])
    return dict(same=same, beams=k, prompt=len(ids), new=T, steps=steps,
                seconds={name: statistics.median(x) for name, x in times.items()},
                copied_per_step=sum(ours.stats["copied_bytes"]) / steps,
                index_select_per_step=sum(ours.stats["index_select_bytes"]) / steps,
                copied_pages=sum(ours.stats["copied_pages"]), forks=sum(ours.stats["forks"]))


# ---- the engine end to end -------------------------------------------------------------------------------------

def engine_run(model, prompts, new, n, temperature, together: bool, prefix_caching: bool) -> dict:
    """n answers to each prompt, as one request of n (together: one prefill, forked) or as n requests (each
    prefilled), answer j of prompt i sampled with seed 1000 i + j either way; seconds, tokens, TTFT."""
    engine = ServingEngine(model, 4096 // PAGE * len(prompts) * 2, PAGE, prefix_caching=prefix_caching)
    t0 = time.perf_counter()
    if together:
        rids = [r + j for i, p in enumerate(prompts)
                for r in [engine.add_request(p, new, n=n, temperature=temperature, seed=1000 * i)] for j in range(n)]
    else:
        rids = [engine.add_request(p, new, temperature=temperature, seed=1000 * i + j)
                for i, p in enumerate(prompts) for j in range(n)]
    while engine.running or engine.waiting:
        engine.step()
    wall, ends = time.perf_counter() - t0, engine.stats["step_times"]
    ttft = [ends[engine.requests[r].events["first_token"]][1] - t0 for r in rids]
    answers = [engine.output(r) for r in rids]
    tokens = sum(map(len, answers))
    return dict(seconds=wall, tokens=tokens, tokens_per_s=tokens / wall, ttft_mean_s=statistics.mean(ttft),
                ttft_max_s=max(ttft), peak_pages=engine.stats["peak_held_pages"]["full"],
                computed_tokens=engine.stats["computed_tokens"], answers=answers)


def engine_end_to_end(model, s: dict) -> dict:
    """The three ways, `engine_rounds` times each, in turns (the order alternating), so that a drift of a shared
    machine's speed falls on all three: each mode's median run by throughput, and every round's throughput."""
    prompts = loadgen.random_prompts(s["engine_prompts"], s["engine_prompt"], seed=11, vocab=model.config.vocab_size)
    args = (model, prompts, s["engine_new"], s["engine_n"], s["temperature"])
    engine_run(model, prompts[:1], 4, 2, s["temperature"], True, True)          # warm-up
    modes = dict(forked=(True, True), apart_cached=(False, True), apart=(False, False))
    runs = {mode: [] for mode in modes}
    bar = tqdm(total=s["engine_rounds"] * len(modes), desc="engine: rounds of forked, apart, apart cached")
    for r in range(s["engine_rounds"]):
        for mode in list(modes)[::(-1) ** r]:
            runs[mode].append(engine_run(*args, *modes[mode]))
            bar.update()
    bar.close()
    out = {mode: dict(sorted(rs, key=lambda x: x["tokens_per_s"])[len(rs) // 2],
                      rounds=[x["tokens_per_s"] for x in rs]) for mode, rs in runs.items()}
    out["same_answers"] = all(x["answers"] == runs["forked"][0]["answers"] for rs in runs.values() for x in rs)
    return out


def http_n(s: dict, vocab: int) -> dict:
    """The lab's server and vLLM's on the same cores, one after the other: `http_prompts` requests of n
    sampled answers at once (throughput), then each prompt's greedy answer (vLLM refuses n > 1 when greedy:
    the lab's n greedy answers equal its one, tests/test_serve.py), compared."""
    if not s["vllm"]:
        return "quick mode: vLLM takes about a minute to start; `make results` runs the comparison"
    if not (loadgen.VLLM_BIN / "python").exists():
        return "vLLM's environment is not built here (make vllm)"
    reqs = loadgen.fixed_requests(s["http_prompts"], s["http_prompt"], s["engine_new"], seed=13, vocab=vocab)
    # no seed: vLLM's CPU build (0.32) fails a seeded request whose prompt takes more than one step ("CPU
    # Generator does not use offset"); the seed changes which tokens come out, not how fast
    sampled = dict(n=s["engine_n"], temperature=s["temperature"])
    out = {}
    for name, server, extra in (("lab", lab_server(cores=CORES, threads=2, num_pages=2048), loadgen.LAB_FIELDS),
                                ("vllm", loadgen.vllm_server(cores=CORES), loadgen.VLLM_FIELDS)):
        with server as (_, url):
            loadgen.run_load(url, reqs[:1], "smollm2", 300, None, extra | sampled)          # warm-up
            recs = loadgen.run_load(url, reqs, "smollm2", 600, None, extra | sampled)
            greedy = loadgen.run_load(url, reqs, "smollm2", 600, None, extra | dict(temperature=0))
        failed = [r.error for r in recs + greedy if not r.ok]
        if failed:
            return f"{name}'s server failed {len(failed)} requests: {failed[0]}"
        summary = loadgen.summarize(recs, slo_ttft=5.0, slo_itl=1.0)
        out[name] = dict(summary, greedy=[r.token_ids for r in greedy])
    out["same_greedy"] = out["lab"]["greedy"] == out["vllm"]["greedy"]
    return out


# ---- attention over a shared prefix ------------------------------------------------------------------------

def attention(s: dict) -> list:
    """lab.cascade_bench over the grid of branches, shared lengths and dtypes: one row per case."""
    from ..cascade_bench import cascade_bench

    return cascade_bench(s["branches"], s["shared"], tuple(getattr(torch, d) for d in s["dtypes"]),
                         rounds=s["rounds"])


def measure(quick_mode=None) -> dict:
    quick_mode = quick() if quick_mode is None else quick_mode
    s = settings(quick_mode)
    smol = load("smollm2")
    m = dict(settings=s, manifest=smol.manifest, threads=torch.get_num_threads())
    m["sampling"] = sampling_memory(s)
    m["beam_memory"] = beam_memory(smol, s)
    m["beams"] = beams_vs_transformers(smol, s)
    m["engine"] = engine_end_to_end(smol, s)
    m["http"] = http_n(s, smol.config.vocab_size)
    m["attention"] = attention(s)
    return m


# ---- the values ----------------------------------------------------------------------------------------------

def values(m: dict) -> dict:
    s, v = m["settings"], {}
    pct = lambda x, **kw: value(100 * x, "%", **kw)
    if "sampling" in m:
        v["sampling"] = {d: {f"n{n}": pct(r["saving"], copies=r["copies"], note=SYNTHETIC)
                             for n, r in m["sampling"][d].items()} for d in m["sampling"]}
        v["sampling"]["requests"] = value(s["sampling_requests"], "requests")
    if "beam_memory" in m:
        v["beam_memory"] = {d: {f"beams{k}": pct(r["saving"], steps=r["steps"], note=SYNTHETIC)
                                for k, r in m["beam_memory"][d].items()} for d in m["beam_memory"]}
        v["beam_memory"]["requests"] = value(s["beam_requests"], "requests", cap=s["beam_cap"])
    if "beams" in m:
        b = m["beams"]
        v["beams"] = dict(same=value(b["same"], None), beams=value(b["beams"], "beams"),
                          prompt=value(b["prompt"], "tokens"), new=value(b["new"], "tokens"),
                          lab_ms_per_step=value(1e3 * b["seconds"]["lab"] / b["new"], "ms"),
                          transformers_ms_per_step=value(1e3 * b["seconds"]["transformers"] / b["new"], "ms"),
                          copied_kib_per_step=value(b["copied_per_step"] / 2**10, "KiB"),
                          index_select_kib_per_step=value(b["index_select_per_step"] / 2**10, "KiB"),
                          copy_ratio=value(b["index_select_per_step"] / max(b["copied_per_step"], 1), "x",
                                           note="index_select's bytes over copy on write's, per step"))
    if "engine" in m:
        e = m["engine"]
        v["engine"] = {mode: dict(tokens_per_s=value(e[mode]["tokens_per_s"], "tok/s", rounds=e[mode]["rounds"],
                                                      note="the median round's"),
                                  ttft_s=value(e[mode]["ttft_mean_s"], "s", max=e[mode]["ttft_max_s"]),
                                  peak_pages=value(e[mode]["peak_pages"], "pages"),
                                  computed_tokens=value(e[mode]["computed_tokens"], "tokens"))
                       for mode in ("forked", "apart_cached", "apart")}
        v["engine"]["same_answers"] = value(e["same_answers"], None, note="answer j of prompt i, seed 1000 i + j")
        v["engine"] |= dict(n=value(s["engine_n"], "answers"), prompts=value(s["engine_prompts"], "prompts"),
                            prompt=value(s["engine_prompt"], "tokens"), new=value(s["engine_new"], "tokens"),
                            speedup=value(e["forked"]["tokens_per_s"] / e["apart"]["tokens_per_s"], "x",
                                          note="forked over n requests without prefix caching"),
                            speedup_cached=value(e["forked"]["tokens_per_s"] / e["apart_cached"]["tokens_per_s"], "x",
                                                 note="forked over n requests with prefix caching"))
    if "attention" in m:
        rows = {(r["dtype"], r["n"], r["shared"]): r for r in m["attention"]}
        v["attention"] = {f"{d}_n{n}_s{sh}": dict(cascade_ms=value(r["cascade_ms"], "ms", iqr=r["cascade_iqr_ms"]),
                                                  paged_ms=value(r["paged_ms"], "ms", iqr=r["paged_iqr_ms"]),
                                                  speedup=value(r["speedup"], "x"),
                                                  cascade_mb=value(r["cascade_MB"], "MB"),
                                                  paged_mb=value(r["paged_MB"], "MB"))
                          for (d, n, sh), r in rows.items()}
        for d in s["dtypes"]:                   # the cascade's throughput at the longest prefix over the shortest
            n, lo, hi = max(s["branches"]), min(s["shared"]), max(s["shared"])
            v["attention"][f"{d}_hold"] = value(rows[(d, n, hi)]["cascade_branch_tokens_per_s"]
                                                / rows[(d, n, lo)]["cascade_branch_tokens_per_s"], "x",
                                                note=f"{n} branches: throughput at {hi} shared over at {lo}")
            v["attention"][f"{d}_paged_hold"] = value(rows[(d, n, hi)]["paged_branch_tokens_per_s"]
                                                      / rows[(d, n, lo)]["paged_branch_tokens_per_s"], "x")
    h = m.get("http", "not measured")
    if isinstance(h, str):
        v["http"] = {name: {"tokens_per_s": not_run(h, "tok/s"), "ttft_s": not_run(h, "s")} for name in ("lab", "vllm")}
        v["http"]["same_greedy"] = not_run(h)
        v["http"]["prompt"] = not_run(h, "tokens")
    elif "lab" in h:
        v["http"] = {name: {"tokens_per_s": value(h[name]["throughput_tok_s"], "tok/s"),
                            "ttft_s": value(h[name]["ttft_median_s"], "s", note="median")} for name in ("lab", "vllm")}
        v["http"]["same_greedy"] = value(h["same_greedy"], None)
        v["http"]["prompt"] = value(s["http_prompt"], "tokens", prompts=s["http_prompts"])
    return v


def record(m: dict) -> dict:
    v = values(m)
    write_section(SECTION, v, provenance(manifest=m["manifest"], threads=m["threads"]))
    return v


if __name__ == "__main__":
    t0 = time.perf_counter()
    record(measure())
    print(f"ch12: done in {time.perf_counter() - t0:.0f} s")
