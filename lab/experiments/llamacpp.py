"""llama.cpp beside the lab, on the same two cores (section "llamacpp"; chapters 6 and 8 and the README cite it).

llama.cpp is what most readers would run on a laptop CPU. It runs here as programs built from
llama-cpp-python's source distribution (`make llamacpp`, lab/peers/llamacpp.py), on three files of the same
model: the Q4_1 file the lab's weights are dequantized from, as it ships, and the lab's float32 weights
written as float32 and bfloat16 GGUF files. Measured, in rounds that interleave the sides:

- weights: the float32 file's tensors against the Q4_1 file's, dequantized (identical, or not);
- agreement: greedy answers of llama-server and the lab's engine to the same held-out passages;
- decode: one sequence's tokens per second after 512 and 4,096 positions of context, `llama-bench` against
  the lab's engine stepping one request;
- serving: llama-server (every file), the lab's server and vLLM's (float32 and bfloat16), sent the same
  loads by the lab's load generator at 1, 16 and 64 requests in flight;
- prompt cache: time to first token of each turn of a multi-turn chat, with the server's prompt cache on
  (a hit: only the new turn is computed) and off, llama-server's `cache_prompt` against the lab's server's
  prefix caching.

`python -m lab.experiments.llamacpp` (LAB_FULL=1 writes results/results.json).
"""

import contextlib
import statistics
import time

import torch
from tqdm.auto import tqdm

from .. import data, loadgen
from ..engine import ServingEngine
from ..models import load
from ..peers import llamacpp
from ..results import not_run, provenance, quick, require_clean, value, write_section
from ..serve.process import lab_server
from ..workloads import conversation

SECTION = "llamacpp"
CORES = "0-1"
THREADS = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FILES = {"float32": "float32", "bfloat16": "bfloat16", "q4_1": "q4_1"}        # llama.cpp's side: model_files() keys


def settings(quick_mode: bool) -> dict:
    if quick_mode:
        return dict(depths=(64,), new_tokens=8, rounds=1, passages=2, passage_tokens=64, answer=8,
                    levels=(1, 4), compared=(4,), prompt=32, output=8, serve_rounds=1, vllm=False,
                    system=64, turns=3, user=16, reply=16, chat_rounds=1, timeout_s=120)
    return dict(depths=(512, 4096), new_tokens=64, rounds=3, passages=8, passage_tokens=128, answer=32,
                levels=(1, 16, 64), compared=(16, 64), prompt=128, output=64, serve_rounds=5, vllm=True,
                system=512, turns=6, user=64, reply=64, chat_rounds=3, timeout_s=300)


# ---- the lab's side of one sequence decoding ----

@torch.inference_mode()
def lab_decode_rate(model, depth: int, new_tokens: int, warmup: int = 4, seed: int = 0) -> float:
    """Tokens per second of the lab's engine decoding one sequence after `depth` positions of random ids:
    the prefill and `warmup` decode steps untimed, then `new_tokens` steps of one token each timed."""
    ids = torch.randint(0, model.config.vocab_size, (depth,), generator=torch.Generator().manual_seed(seed))
    total = depth + warmup + new_tokens + 1
    engine = ServingEngine(model, num_pages=total // 16 + 2, page_size=16, max_batch_tokens=512)
    rid = engine.add_request(ids.tolist(), max_new_tokens=warmup + new_tokens + 1)
    while len(engine.output(rid)) < 1 + warmup:
        engine.step()
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        engine.step()
    seconds = time.perf_counter() - t0
    assert len(engine.output(rid)) == 1 + warmup + new_tokens
    return new_tokens / seconds


def decode(models: dict, files: dict, s: dict) -> dict:
    """{depth: {side: {"tok_s": median, "rounds": [...]}}}, side "lab_float32", "llamacpp_q4_1", ...: each
    round runs every side once at every depth, llama.cpp and the lab alternating first."""
    def rate(side, depth, r):
        kind, name = side.split("_", 1)
        if kind == "llamacpp":
            return llamacpp.bench(files[name], depth, s["new_tokens"], THREADS, CORES)["tok_s"]
        return lab_decode_rate(models[name], depth, s["new_tokens"], seed=r)

    sides = [f"llamacpp_{name}" for name in files] + [f"lab_{name}" for name in models]
    runs = {}
    for r in tqdm(range(s["rounds"]), desc="decode rounds", leave=False):
        for depth in s["depths"]:
            for side in (sides if r % 2 == 0 else sides[::-1]):
                time.sleep(1.0)                                    # the other side's threads go quiet
                runs.setdefault(depth, {}).setdefault(side, []).append(rate(side, depth, r))
    return {d: {k: dict(tok_s=statistics.median(x), rounds=x) for k, x in sides.items()} for d, sides in runs.items()}


# ---- greedy answers on both sides ----

def agreement(models: dict, files: dict, s: dict) -> dict:
    """Greedy answers of `answer` tokens to held-out passages: llama-server on each file against the lab's
    engine in the file's dtype (Q4_1 against float32, its dequantized weights). {file: {"identical": n,
    "passages": n, "first_difference": [index of the first differing token, or None per passage]}}."""
    tok = models["float32"].tokenizer
    prompts = data.passages(tok, s["passage_tokens"], s["passages"])
    out = {}
    for name, f in files.items():
        lab_model = models["float32" if name == "q4_1" else name]
        engine = ServingEngine(lab_model, num_pages=s["passages"] * ((s["passage_tokens"] + s["answer"]) // 16 + 2))
        ours = engine.generate(prompts, s["answer"])
        with llamacpp.server(f, CORES, THREADS, slots=1, context=s["passage_tokens"] + s["answer"] + 16) as (_, url):
            theirs = llamacpp.greedy(url, prompts, s["answer"])
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                 for x, y in zip(ours, theirs, strict=True)]
        out[name] = dict(identical=sum(x == y for x, y in zip(ours, theirs, strict=True)), passages=len(prompts),
                         first_difference=first)
    return out


# ---- servers ----

def serving(files: dict, s: dict) -> dict:
    """compare_servers over llama-server (every file), the lab's server and vLLM's (float32 and bfloat16):
    c requests of `prompt` random ids and `output` tokens in flight, rounds at the compared levels."""
    lab = lambda **kw: (lab_server(cores=CORES, threads=THREADS, num_pages=1024, **kw), loadgen.LAB_FIELDS)
    slots, context = max(s["levels"]), s["prompt"] + s["output"] + 64
    servers = {"lab_float32": lab(), "lab_bfloat16": lab(dtype="bfloat16")}
    servers |= {f"llamacpp_{name}": (llamacpp.server(f, CORES, THREADS, slots, context), loadgen.LLAMACPP_FIELDS,
                                     loadgen.LLAMACPP_PATH) for name, f in files.items()}
    missing = {}
    if s["vllm"] and (loadgen.VLLM_BIN / "python").exists():
        servers |= {f"vllm_{d}": (loadgen.vllm_server(cores=CORES, dtype=d), loadgen.VLLM_FIELDS) for d in DTYPES}
    else:
        why = ("quick mode: vLLM takes about a minute to start" if not s["vllm"]
               else "vLLM's environment is not built here (make vllm)")
        missing = {f"vllm_{d}": why for d in DTYPES}
    out = loadgen.compare_servers(servers, s["levels"], s["prompt"], s["output"], rates=(), rate_requests=0,
                                  max_prompt=s["prompt"], max_output=s["output"], sequential=1,
                                  rounds=s["serve_rounds"], compare_at=s["compared"], timeout_s=s["timeout_s"])
    return out | missing


# ---- a cached prompt ----

def prompt_cache(files: dict, s: dict, vocab: int) -> dict:
    """Time to first token of each turn of one multi-turn chat (turn k's prompt is turn k-1's and a reply
    and a new message), sent one turn at a time: {server: {"hit": [ttft per turn], "miss": [...]}} with the
    servers' prompt caches on and off, medians over `chat_rounds` rounds. llama-server (float32 file, one
    slot, cache_prompt true or false per request) and the lab's server (float32, prefix caching on or off:
    two servers)."""
    turns = conversation(vocab, s["system"], s["turns"], s["user"], s["reply"])
    servers = {"llamacpp_hit": (llamacpp.server(files["float32"], CORES, THREADS, slots=1, context=4096),
                                loadgen.LLAMACPP_FIELDS | {"cache_prompt": True}, loadgen.LLAMACPP_PATH),
               "llamacpp_miss": (llamacpp.server(files["float32"], CORES, THREADS, slots=1, context=4096),
                                 loadgen.LLAMACPP_FIELDS | {"cache_prompt": False}, loadgen.LLAMACPP_PATH),
               "lab_hit": (lab_server(cores=CORES, threads=THREADS, num_pages=1024), loadgen.LAB_FIELDS),
               "lab_miss": (lab_server(cores=CORES, threads=THREADS, num_pages=1024, prefix_caching=False),
                            loadgen.LAB_FIELDS)}
    ttft = {name: [[] for _ in turns] for name in servers}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(srv)[1] for name, (srv, *_) in servers.items()}
        for r in tqdm(range(s["chat_rounds"]), desc="chat rounds", leave=False):
            for name in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                salt = [r + 1]                                     # a new chat each round: no hit across rounds
                for k, ids in enumerate(turns):
                    time.sleep(0.5)
                    req = loadgen.Request(0.0, salt + ids, 4)
                    (rec,) = loadgen.run_load(urls[name], [req], "smollm2", s["timeout_s"], 1, *servers[name][1:])
                    if not rec.ok:
                        raise RuntimeError(f"{name}, turn {k}: {rec.error}")
                    ttft[name][k].append(rec.ttft)
    return {name: [statistics.median(x) for x in per_turn] for name, per_turn in ttft.items()} | dict(
        prompt_tokens=[len(t) + 1 for t in turns])


# ---- measure and record ----

def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    models = {name: load("smollm2", dtype=d) for name, d in DTYPES.items()}
    files = {name: llamacpp.model_files()[key] for name, key in FILES.items()}
    m = dict(settings=s, manifest=models["float32"].manifest, build=llamacpp.build_info(),
             threads=torch.get_num_threads())
    m["weights"] = {name: llamacpp.weights_agree(files[name]) for name in ("float32", "bfloat16")}
    m["agreement"] = agreement(models, files, s)
    m["decode"] = decode(models, files, s)
    m["serving"] = serving(files, s)
    m["prompt_cache"] = prompt_cache(files, s, models["float32"].config.vocab_size)
    return m


def values(m: dict) -> dict:
    from .ch08_serving import rounds_ratio
    s = m["settings"]
    v = {"threads": value(THREADS, "threads", note="llama.cpp's -t and -tb, the lab's torch threads, on cores "
                                                    f"{CORES}"),
         "build": value(m["build"]["package"], None, flags=m["build"]["flags"], llama_cpp=m["build"]["upstream"]),
         "build_seconds": value(m["build"]["seconds"], "s", jobs=m["build"]["jobs"],
                                note="`make llamacpp` from the unpacked source: cmake's configure and build")}
    v["weights"] = {name: {"identical": value(w["identical"], "tensors", of=w["tensors"]),
                           "max_abs_diff": value(w["max_abs_diff"], None)} for name, w in m["weights"].items()}
    v["agreement"] = {name: {"identical": value(a["identical"], "passages", first_difference=a["first_difference"],
                                                note=f"greedy, {s['answer']} tokens after {s['passage_tokens']} "
                                                     "of a held-out play"),
                             "passages": value(a["passages"], "passages")} for name, a in m["agreement"].items()}
    v["decode"] = {}
    for depth, sides in m["decode"].items():
        d = {name: value(x["tok_s"], "tok/s", rounds=x["rounds"], new_tokens=s["new_tokens"])
             for name, x in sides.items()}
        for dt in DTYPES:
            lab, ref = sides[f"lab_{dt}"], sides[f"llamacpp_{dt}"]
            d[f"ratio_{dt}"] = rounds_ratio(lab["rounds"], ref["rounds"], f"the lab's engine over llama-bench, "
                                            f"one sequence, {dt}: the median of the rounds' ratios")
        v["decode"][f"d{depth}"] = d
    v["serving"] = serving_values(m["serving"], s)
    v["prompt_cache"] = prompt_cache_values(m["prompt_cache"])
    v["shape"] = {"prompt": value(s["prompt"], "tokens"), "output": value(s["output"], "tokens"),
                  "passage": value(s["passage_tokens"], "tokens"), "answer": value(s["answer"], "tokens"),
                  "new_tokens": value(s["new_tokens"], "tokens"), "rounds": value(s["rounds"], "runs")}
    return v


def serving_values(h: dict, s: dict) -> dict:
    from .ch08_serving import ratios, server_values
    v = {name: ({"throughput": not_run(r, "tok/s")} if isinstance(r, str) else server_values(r))
         for name, r in h.items()}
    pairs = {f"{dt}_llamacpp": (f"lab_{dt}", f"llamacpp_{dt}") for dt in DTYPES}
    pairs["q4_1_llamacpp"] = ("lab_bfloat16", "llamacpp_q4_1")
    if isinstance(h.get("vllm_float32"), dict):
        pairs |= {f"{dt}_vllm": (f"lab_{dt}", f"vllm_{dt}") for dt in DTYPES}
    v["ratios"] = ratios(h, pairs, s["compared"])
    v["failed"] = value(sum(x["failed"] for r in h.values() if isinstance(r, dict) for x in r["concurrency"].values()),
                        "requests", note="requests that failed, every server and load")
    return v


def prompt_cache_values(p: dict) -> dict:
    """Per server, the median TTFT over turns 2 and later (turn 1 has nothing to hit) with and without the
    prompt cache, and the speedup."""
    v = {"prompt_tokens": value(p["prompt_tokens"][-1], "tokens", turns=p["prompt_tokens"])}
    for side in ("llamacpp", "lab"):
        hit, miss = p[f"{side}_hit"][1:], p[f"{side}_miss"][1:]
        v[side] = {"hit_ms": value(statistics.median(hit) * 1e3, "ms", turns=[x * 1e3 for x in p[f"{side}_hit"]]),
                   "miss_ms": value(statistics.median(miss) * 1e3, "ms", turns=[x * 1e3 for x in p[f"{side}_miss"]]),
                   "speedup": value(statistics.median(miss) / statistics.median(hit), "x",
                                    note="TTFT without the prompt cache over with it, turns 2 and later")}
    return v


def record(m: dict) -> dict:
    v = values(m)
    b = m["build"]
    write_section(SECTION, v, provenance(manifest=m["manifest"], cores=CORES, peer=f"llama.cpp from {b.get('package')}"
                                         f" ({b.get('upstream')}), built with {' '.join(b.get('flags', []))}"))
    return v


def run(quick_mode=None) -> dict:
    if not llamacpp.available():
        why = "llama.cpp is not built here (make llamacpp)"
        v = {"build": not_run(why)}
        write_section(SECTION, v, provenance(note=why))
        return v
    return record(measure(quick_mode))


if __name__ == "__main__":
    require_clean()
    run()
