"""The README's headline table, generated from results.json (`python -m lab.book.readme`; `make book` runs it).

The README never types a measured number: the block between the markers is rewritten from the results
file, and a test fails when the committed README differs from what the committed results produce.
"""

import sys

from lab.book.render import render_text
from lab.results import COMMITTED, REPO_ROOT, format_value, lookup, read

START, END = "<!-- results:start -->", "<!-- results:end -->"

# (what, key, format spec): the headline numbers, chapter by chapter
HEADLINES = [
    ("Ch. 1 — positions processed, 17-token prompt + 32 new tokens, no cache (counted)",
     "ch01.loop.positions_uncached", ""),
    ("Ch. 1 — the same with a cache (formula; measured in ch. 3)", "ch01.loop.formula_cached", ""),
    ("Ch. 1 — one uncached SmolLM2 step at 16 tokens of context / at the longest context measured, and that context",
     ("ch01.step_ms.smollm2.T16", "ch01.step_ms.smollm2.longest_s", "ch01.step_ms.smollm2.longest_T"), ""),
    ("Ch. 1 — the same, GPT-2 small shape",
     ("ch01.step_ms.gpt2-random.T16", "ch01.step_ms.gpt2-random.longest_s", "ch01.step_ms.gpt2-random.longest_T"),
     ""),
    ("Ch. 1 — our forward vs transformers, SmolLM2: logits identical to the last bit", "ch01.parity.smollm2.identical",
     ""),
    ("Ch. 1 — our forward vs transformers, GPT-2 shape, max abs logit difference",
     "ch01.parity.gpt2-random.max_abs", ""),
    ("Ch. 1 — SmolLM2 perplexity, held-out Shakespeare / same words shuffled",
     ("ch01.perplexity.heldout", "ch01.perplexity.shuffled"), ".1f|number"),
    ("Ch. 1 — KV bytes per position, SmolLM2-135M (16-bit)", "ch01.bytes_per_position.SmolLM2-135M.kib", ""),
    ("Ch. 2 — cached vs recomputed logits, SmolLM2, every step (max abs difference, static / concat)",
     ("ch02.agreement.smollm2.static.vs_recompute_max", "ch02.agreement.smollm2.concat.vs_recompute_max"), ""),
    ("Ch. 2 — cached greedy tokens identical to recomputation (SmolLM2, static cache), and the steps compared",
     ("ch02.agreement.smollm2.static.tokens_identical", "ch02.agreement.smollm2.static.steps"), ""),
    ("Ch. 3 — cached step speedup at T = 512, GPT-2 small shape / SmolLM2 (static cache, median over rounds)",
     ("ch03.speedup.gpt2-random.T512.static", "ch03.speedup.smollm2.T512.static"), ".1f"),
    ("Ch. 3 — attention's share of a cached SmolLM2 decode step at 4,096 tokens: measured time / FLOP count",
     ("ch03.attention_share.smollm2.T4096", "ch03.attention_flop_share.smollm2.T4096"), ".0f"),
    ("Ch. 3 — lab / transformers time per decode token at 512, static caches, GPT-2 shape / SmolLM2",
     ("ch03.library.gpt2-random.ratio_static", "ch03.library.smollm2.ratio_static"), ".2f"),
    ("Ch. 3 — peak extra memory decoding 960 tokens at batch 8, GPT-2 shape, concat / static (MiB)",
     ("ch03.memory.gpt2-random.concat.B8.peak_extra_mib", "ch03.memory.gpt2-random.static.B8.peak_extra_mib"),
     ".0f"),
    ("Ch. 3 — a SmolLM2 decode step beside four other torch programs on two cores, over idle: OpenMP's defaults / "
     "the lab's OMP_WAIT_POLICY=PASSIVE; and PASSIVE's cost on an idle machine",
     ("ch03.under_load.default.busy_slowdown", "ch03.under_load.lab.busy_slowdown", "ch03.under_load.idle_cost"),
     ".1f"),
    ("Ch. 3 — the same on a GPU", "ch03_gpu.step_ms", ""),
    ("Ch. 3 — a cached SmolLM2 decode step at 512 tokens, float32 over bfloat16 (interleaved rounds): F.linear / "
     "oneDNN prepacked; bfloat16's KL to float32 (nats, held-out text)",
     ("ch03.bf16.speedup", "ch03.bf16.speedup_packed", "ch03.bf16.kl_mean"), ".2g"),
    ("Ch. 4 — another prompt's cache: median / max abs Δ logit against a correct computation",
     ("ch04.hazards.other_prompt.delta_median", "ch04.hazards.other_prompt.delta_max"), ".2f"),
    ("Ch. 4 — MLP output × 1.02 (adapter swap): median abs Δ logit, trials with the same top token, trials run",
     ("ch04.hazards.adapter_weights.delta_median", "ch04.hazards.adapter_weights.argmax_agree",
      "ch04.hazards.adapter_weights.trials"), ".3g"),
    ("Ch. 4 — identity-changing hazards refused by the CachedBackend (another prompt / adapter / bf16), trials run",
     ("ch04.hazards.other_prompt.refused", "ch04.hazards.adapter_weights.refused", "ch04.hazards.bf16_cache.refused",
      "ch04.hazards.other_prompt.trials"), ""),
    ("Ch. 4 — the CachedBackend's identity check per call at 4,096 ids, and its share of a cached decode step",
     ("ch04.check_us.T4096", "ch04.check_share.T4096"), (",.0f", ".3g")),
    ("Ch. 5 — reserved KV memory holding real tokens, synthetic ShareGPT-shaped lengths: contiguous at 2,048 / "
     "pages of 16", ("ch05.utilization.ShareGPT.contiguous_max", "ch05.utilization.ShareGPT.paged_16"), ".1f"),
    ("Ch. 5 — the same, synthetic Alpaca-shaped lengths",
     ("ch05.utilization.Alpaca.contiguous_max", "ch05.utilization.Alpaca.paged_16"), ".1f"),
    ("Ch. 5 — decode attention over pages / contiguous, CPU, context 4,096, warm caches, batch 1 / batch 8",
     ("ch05.speed.B1.T4096.ratio", "ch05.speed.B8.T4096.ratio"), ".2f"),
    ("Ch. 5 — the same with the caches flushed before every call",
     ("ch05.speed.B1.T4096.cold.ratio", "ch05.speed.B8.T4096.cold.ratio"), ".2f"),
    ("Ch. 5 — the same, warm, on one thread",
     ("ch05.speed.B1.T4096.one_thread.ratio", "ch05.speed.B8.T4096.one_thread.ratio"), ".2f"),
    ("Ch. 5 — Triton kernel bandwidth on a GPU", "ch05_gpu.bandwidth", ""),
    ("Ch. 6 — prompt tokens served from cache by a pool that never evicts, synthetic workloads: system prompts "
     "/ multi-turn chats / few-shot", tuple(f"ch06.workloads.{w}.hit_rate_best" for w in
                                          ("system_prompts", "multi_turn_chats", "few_shot")), ".0f"),
    ("Ch. 6 — time to first token, SmolLM2 on the CPU, 1,024 cached tokens + 16 new: hit / miss",
     ("ch06.ttft.T1024.hit_ms", "ch06.ttft.T1024.miss_ms"), ""),
    ("Ch. 6 — the same, miss over hit", "ch06.ttft.T1024.ratio", ".1f"),
    ("Ch. 6 — naming pages (sha256 chain), per token", "ch06.hashing_us_per_token", ".2f"),
    ("Ch. 6 — timing side channel, ROC AUC of guessing another tenant's first page: one shared cache / a salt "
     "per tenant", ("ch06.side_channel.shared.auc", "ch06.side_channel.salted.auc"), ".2f"),
    ("Ch. 6 — the lab against vLLM (pages of 32): cached tokens per request identical / 32 greedy tokens "
     "identical", ("ch06.vllm.cached_identical", "ch06.vllm.tokens_identical"), ""),
    ("Ch. 6 — time to first token, 528-token prompt, hit / miss: the lab / vLLM",
     ("ch06.vllm.lab.ttft_hit_ms", "ch06.vllm.lab.ttft_miss_ms", "ch06.vllm.vllm.ttft_hit_ms",
      "ch06.vllm.vllm.ttft_miss_ms"), ""),
    ("Ch. 6 — input cost saved by prompt caching on a ten-turn conversation (synthetic): Anthropic 5-minute / "
     "OpenAI gpt-4.1 / Gemini explicit", ("ch06.economics.anthropic_5_minute_cache.saving",
                                          "ch06.economics.openai_automatic.saving",
                                          "ch06.economics.gemini_explicit_cache.saving"), ".0f"),
    ("Ch. 7 — KL to the uncompressed model (nats), SmolLM2, held-out text: per-token INT8 / the same, keys smoothed / "
     "KIVI 4-bit / KIVI 2-bit", tuple(f"ch07.quantized.{n}.kl" for n in
                                     ("per_token_8", "per_token_8_smooth", "kivi_4", "kivi_2")), ".2g|number"),
    ("Ch. 7 — bytes per position over a bfloat16 cache's: per-token INT8 / KIVI 4-bit / KIVI 2-bit",
     tuple(f"ch07.quantized.{n}.over_bf16" for n in ("per_token_8", "kivi_4", "kivi_2")), ".3f|number"),
    ("Ch. 7 — KL (nats) with one INT8 scale per tensor (simulated): SmolLM2 / the same function with outlier key "
     "channels", ("ch07.quantized.per_tensor_8.kl", "ch07.outliers.per_tensor_8.kl"), ".2g|number"),
    ("Ch. 7 — KL (nats) of transformers' QuantizedCache on the same text: quanto 4-bit / quanto 2-bit / FP8",
     tuple(f"ch07.transformers.{n}.kl" for n in ("quanto_4", "quanto_2", "fp8")), ".2g|number"),
    ("Ch. 7 — held-out loss keeping 256 positions: window / sinks / H2O / SnapKV; the uncompressed model",
     tuple(f"ch07.eviction.{p}_256.loss" for p in ("window", "sinks", "h2o", "snapkv")) + ("ch07.ref_loss",),
     ".2f|number"),
    ("Ch. 7 — the lab against kvpress, half the context removed, loss: StreamingLLM lab / kvpress, SnapKV lab / "
     "kvpress", ("ch07.kvpress.ratio_50.streaming_llm.lab_loss", "ch07.kvpress.ratio_50.streaming_llm.peer_loss",
                 "ch07.kvpress.ratio_50.snapkv.lab_loss", "ch07.kvpress.ratio_50.snapkv.peer_loss"), ".4f|number"),
    ("Ch. 7 — decode step after 1,024 tokens, CPU, PyTorch: float cache / per-token INT8 / KIVI 2-bit",
     tuple(f"ch07.steps.{n}.ms" for n in ("float", "per_token_8", "kivi_2")), ".1f"),
    ("Ch. 8 — output tokens/s, SmolLM2 on the same two CPU cores, 16 requests in flight over HTTP: the lab's "
     "server / vLLM's; lab over vLLM", ("ch08.http.lab.concurrency.c16.throughput",
                                        "ch08.http.vllm.concurrency.c16.throughput", "ch08.http.ratio"), ".3g"),
    ("Ch. 8 — the lab's server over vLLM's, output tokens/s, same two cores: float32 at 16 / 64 in flight; "
     "bfloat16 at 16 / 64",
     tuple(f"ch08.http.ratios.{d}.c{c}.ratio" for d in ("float32", "bfloat16") for c in (16, 64)), ".2f"),
    ("Ch. 8 — the lab's server at 16 in flight, output tokens/s: the engine in a process of its own / in the "
     "server's process", ("ch08.http.lab.concurrency.c16.throughput",
                          "ch08.http.lab_one_process.concurrency.c16.throughput"), ".3g"),
    ("Ch. 8 — the engine in process, output tokens/s: one request at a time / 16 at once / 64 at once",
     ("ch08.batching.sequential", "ch08.batching.c16", "ch08.batching.c64"), ".1f"),
    ("Ch. 8 — greedy tokens against vLLM's, share of requests: identical / identical or a prefix (the lab "
     "stopped at the end-of-turn token)", ("ch08.http.agreement", "ch08.http.agreement_prefix"), ".0%|number"),
    ("Ch. 8 — worst gap between decoded tokens while a 1,536-token prompt arrives: prefilled whole / in chunks "
     "of 256", ("ch08.chunked.whole.itl_max_ms", "ch08.chunked.chunked.itl_max_ms"), ".0f"),
    ("Ch. 8 — a decode step of 16 sequences: prepacked weights / F.linear",
     ("ch08.step_costs.engine.step_ms", "ch08.step_costs.unpacked.step_ms"), ".0f"),
    ("Ch. 8 — shared 512-token system prompt, 16 requests: positions computed with prefix caching / without",
     ("ch08.prefix.cached.computed", "ch08.prefix.uncached.computed"), ""),
    ("Ch. 8 — the engine on a GPU, 256 requests at once", "ch08_gpu.engine.C256.output_tok_s", ""),
    ("Ch. 9 — guesses accepted at k = 4 on the copy task: prompt lookup / self-draft over 2-bit KIVI / first 20 of "
     "30 layers", tuple(f"ch09.acceptance.copy.{d}.k4.acceptance" for d in ("lookup", "kivi2", "early20")), ".0f"),
    ("Ch. 9 — decode speedup over plain decoding, prompt lookup on a passage that starts over: 256 / 4,096 "
     "positions; self-draft over a 64-position window at 4,096",
     ("ch09.speed.c256.lookup.speedup", "ch09.speed.c4096.lookup.speedup", "ch09.speed.c4096.window.speedup"), ".2f"),
    ("Ch. 9 — the engine with prompt lookup over without, copy requests: 1 / 16 in flight",
     ("ch09.engine.c1.lookup.speedup", "ch09.engine.c16.lookup.speedup"), ".2f"),
    ("Ch. 9 — multi-turn prefix hits (positions from named pages): without speculation / with",
     ("ch09.prefix.plain_cached", "ch09.prefix.lookup_cached"), ""),
    ("Ch. 10 — KL (nats) to SmolLM2 without training: a latent of rank 192 / 96; one pooled KV head; layers "
     "shared by 2; local layers (window 512, 1 global in 6, 4 sinks)",
     ("ch10.quality.latent.rank_192.kl", "ch10.quality.latent.rank_96.kl", "ch10.quality.heads.1_kv_head.kl",
      "ch10.quality.shared.every_2.kl", "ch10.quality.local.w512_g6_s4.kl"), ".3g|number"),
    ("Ch. 10 — best KL (nats) at most a quarter / a tenth of the bf16 cache's bytes, chapters 7 and 10 together",
     ("ch10.best.quarter.kl", "ch10.best.tenth.kl"), ".3g|number"),
    ("Ch. 10 — one sequence of 8,193 positions, SmolLM2 with every sixth layer global (windows of 1,024), bf16: "
     "hybrid pool / every layer keeping every page", ("ch10.hybrid.hybrid_mib", "ch10.hybrid.full_mib"), ".1f"),
    ("Ch. 10 — a latent decode step (rank 96) over the original model's at 4,096 positions: absorbed / "
     "reconstructing", ("ch10.steps.T4096.absorbed_r96.over_original",
                        "ch10.steps.T4096.reconstructing_r96.over_original"), ".2f"),
    ("Ch. 11 — prompt tokens from cache, system prompts, smallest pool: no tier / a host tier 4x the pool / host "
     "and disk", ("ch11.tiers.system_prompts.no_tier", "ch11.tiers.system_prompts.host_tier",
                  "ch11.tiers.system_prompts.host_disk"), ".0f"),
    ("Ch. 11 — one page of SmolLM2 (float32): restored from host memory / from disk / computed again",
     ("ch11.restore.host_ms_per_page", "ch11.restore.disk_ms_per_page", "ch11.restore.recompute_ms_per_page"),
     (".3f", ".2f", ".1f")),
    ("Ch. 11 — router hit rate, round robin / KV-aware: 2 workers measured; 16 simulated",
     ("ch11.routers.measured.round_robin.hit_rate", "ch11.routers.measured.kv_aware.hit_rate",
      "ch11.routers.simulated.round_robin.w16.hit_rate", "ch11.routers.simulated.kv_aware.w16.hit_rate"), ".1f"),
    ("Ch. 11 — NVIDIA Dynamo in front of two vLLM CPU workers, prompt tokens cached: KV router / round robin",
     ("ch11.dynamo.kv.cached", "ch11.dynamo.round_robin.cached"), ".1f"),
    ("Ch. 11 — prefill apart from decode over one engine, same load and memory: throughput",
     "ch11.disagg.throughput_ratio", ".2f"),
    ("Ch. 12 — page-steps saved by forking n = 16 sampled answers, Alpaca / ShareGPT lengths (%)",
     ("ch12.sampling.Alpaca.n16", "ch12.sampling.ShareGPT.n16"), ".1f"),
    ("Ch. 12 — page-steps saved by beam search on pages, 4 beams, Alpaca / ShareGPT lengths (%)",
     ("ch12.beam_memory.Alpaca.beams4", "ch12.beam_memory.ShareGPT.beams4"), ".0f"),
    ("Ch. 12 — beam search, bytes copied per step: transformers' reordering over copy on write",
     "ch12.beams.copy_ratio", ".0f"),
    ("Ch. 12 — decode attention of 16 answers over 16,384 shared positions: paged kernel's time over the cascade's",
     "ch12.attention.float32_n16_s16384.speedup", ".2f"),
    ("Ch. 12 — the engine, 8 answers per prompt: forked / as 8 requests / as 8 requests with prefix caching (tok/s)",
     ("ch12.engine.forked.tokens_per_s", "ch12.engine.apart.tokens_per_s", "ch12.engine.apart_cached.tokens_per_s"),
     ".0f"),
    ("Beside llama.cpp — one sequence decoding after 512 positions, the lab's engine over llama-bench: float32 / "
     "bfloat16", ("llamacpp.decode.d512.ratio_float32", "llamacpp.decode.d512.ratio_bfloat16"), ".2f"),
    ("Beside llama.cpp — the lab's server over llama-server, same dtype: float32 at 16 / 64 in flight, bfloat16 at "
     "16 / 64", tuple(f"llamacpp.serving.ratios.{d}_llamacpp.c{c}.ratio" for d in ("float32", "bfloat16")
                      for c in (16, 64)), ".2f"),
    ("Beside llama.cpp — greedy answers identical on the same float32 weights (passages)",
     ("llamacpp.agreement.float32.identical", "llamacpp.agreement.float32.passages"), ""),
    ("Beside llama.cpp — `make llamacpp`, building it from source on two cores", "llamacpp.build_seconds", ".0f"),
    ("Time to run each chapter's notebook in quick mode, chapters 1 / 2 / 3 / 4 / 5 / 6 / 7 / 8 / 9 / 10 / 11 / 12 "
     "(two CPU cores)", tuple(f"notebooks.seconds.{name}" for name in
                              ("ch01_recompute", "ch02_build", "ch03_savings", "ch04_identity", "ch05_paged",
                               "ch06_prefix", "ch07_compress", "ch08_serving", "ch09_speculation",
                               "ch10_architecture", "ch11_beyond", "ch12_branches")), ".0f"),
]


def table(doc, source="results") -> str:
    assert not any("|" in what for what, _, _ in HEADLINES), "a | would split the markdown table's cells"
    rows = ["| result | value |", "|---|---|"]
    for what, keys, spec in HEADLINES:
        keys = (keys,) if isinstance(keys, str) else keys
        specs = spec if isinstance(spec, tuple) else (spec,) * len(keys)        # one format, or one per key
        cells = [_cell(lookup(doc, k, source), f) for k, f in zip(keys, specs, strict=True)]
        rows.append(f"| {what} | {' / '.join(cells)} |")
    return "\n".join(rows) + "\n\nMeasured on: " + measured_on(doc) + "."


def measured_on(doc) -> str:
    """Each machine that measured a section, with its dates and its sections: which numbers can be compared."""
    runs = {}
    for name, section in doc["sections"].items():
        p = section["provenance"]
        runs.setdefault(_machine(p), []).append((name, p["date"][:10]))
    parts = []
    for machine, sections in sorted(runs.items()):
        dates = sorted({d for _, d in sections})
        when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
        parts.append(f"{machine}, {when}: {', '.join(n for n, _ in sections)}")
    return "; ".join(parts)


def _cell(leaf, spec) -> str:
    """One value of a row; a boolean reads "yes" or "no"."""
    return format_value(leaf, "|bool:yes/no" if isinstance(leaf["value"], bool) else spec)


def _machine(p) -> str:
    m = p["machine"]
    gpu = f", GPU {p['gpu']}" if p.get("gpu") else ", no GPU"
    return (f"{m.get('processor', '?')} ({m.get('cpu_count', '?')} CPUs, {m.get('torch_threads', '?')} torch threads)"
            f"{gpu}, torch {p['versions'].get('torch')}, {p['mode']} mode")


# Where the lab stands beside llama.cpp, in words the results choose (rendered as the book's prose is, so that a
# verdict that no longer holds changes its word, and a claim that fails stops the build).
BESIDE_LLAMACPP = """### Beside llama.cpp

llama.cpp, built from source by `make llamacpp`, runs the same model on the same two cores (chapter 8). One
sequence decoding after 512 positions, the lab's engine runs at
{{calc: 100 * llamacpp.decode.d512.ratio_float32|.0f}}% of llama.cpp's speed in float32 and
{{calc: 100 * llamacpp.decode.d512.ratio_bfloat16|.0f}}% in bfloat16 (after 4,096:
{{calc: 100 * llamacpp.decode.d4096.ratio_float32|.0f}}% and
{{calc: 100 * llamacpp.decode.d4096.ratio_bfloat16|.0f}}%). A step of one sequence should cost about one read of
the weights; llama.cpp's is one compute graph in C, and the engine runs a step of up to sixteen decodes the same way
(as many as the server gives it after timing both steps at start), every layer in one C++ call (chapter 3
times it against the machine's roofline). Larger batches run the reference step, Python calling a dozen torch
operators a layer, a fixed cost per step that the batch shares.
Serving 16 and 64 requests at once, the lab's server is
{{verdict: min(llamacpp.serving.ratios.float32_llamacpp.c16.low,
  llamacpp.serving.ratios.float32_llamacpp.c64.low) > 1|ahead of llama-server in every round/not ahead of
  llama-server in every round}} in float32 and
{{verdict: min(llamacpp.serving.ratios.bfloat16_llamacpp.c16.low,
  llamacpp.serving.ratios.bfloat16_llamacpp.c64.low) > 1|ahead of it in every round/not ahead of it in every
  round}} in bfloat16 (the table above; chapter 8 has every load and vLLM beside both)."""


def durations(doc) -> str:
    """How long each section of the results took to measure, on its own clock (`wall_seconds`), and their sum:
    what a reader running `make results` on the same machine should plan for. A section measured before
    sections recorded their time is named, not guessed."""
    seconds = {n: s["provenance"].get("wall_seconds") for n, s in doc["sections"].items()}
    timed = {n: t for n, t in seconds.items() if t is not None}
    parts = ", ".join(f"{n} {t / 60:.1f}" for n, t in timed.items())
    missing = [n for n, t in seconds.items() if t is None]
    what = ("The sections that recorded their time took" if missing
            else "The sections of a full `make results`, each measured on its own, took")
    processors = {doc["sections"][n]["provenance"].get("machine", {}).get("processor") for n in timed}
    where = (f" of the {processors.pop()}" if len(processors) == 1 and None not in processors
             else " of more than one machine (see above)" if len(processors) > 1 else "")
    text = (f"{what} {sum(timed.values()) / 60:.0f} minutes on two cores{where} (minutes per section: {parts}), "
            f"besides building the peers and the book.")
    return text + (f" Not timed (measured before sections recorded their time): {', '.join(missing)}." if missing
                   else "")


def block(doc) -> str:
    return f"{START}\n{table(doc)}\n\n{durations(doc)}\n\n{render_text(BESIDE_LLAMACPP, doc)}\n{END}"


def rewrite(readme=REPO_ROOT / "README.md", results=COMMITTED) -> bool:
    """Replace the README's results block; True when it changed."""
    text = readme.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{readme} has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    new = head + block(read(results)) + rest.split(END, 1)[1]
    readme.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = rewrite()
    print("README results table", "updated" if changed else "unchanged", file=sys.stderr)
