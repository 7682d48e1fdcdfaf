"""Prefill apart from decode against one engine (chapter 11): the same prompts and arrivals through
`Disaggregated` (lab/serve/disagg.py, two engine processes) and through one ServingEngine, each request's
timeline summarized as TTFT, gaps between tokens (ITL), throughput and bytes moved."""

import itertools

import numpy as np
import torch
from tqdm.auto import tqdm

from .engine import ServingEngine, drive
from .engine.disagg import checked, clock, entry, warm_up
from .models import load
from .serve.disagg import Disaggregated


@torch.inference_mode()
def colocated(model, prompts, max_new_tokens, arrivals_s=None, num_pages: int = 128, page_size: int = 16,
              max_batch_tokens: int = 256, threads: int = 2) -> tuple[list, list]:
    """The baseline: one ServingEngine in this process on `threads` threads (chunked prefill beside the
    decodes), the same prompts and arrivals as `Disaggregated.generate`, the same (tokens, timeline)."""
    prompts, news, arrivals = checked(prompts, max_new_tokens, arrivals_s)
    n, before = len(prompts), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = load(model) if isinstance(model, str) else model
        warm_up(model, page_size)
        engine, times, t0 = ServingEngine(model, num_pages, page_size, max_batch_tokens), {}, clock()

        def stamp(engine, new):                                       # each token's time, on this clock
            t = clock()
            for rid, tokens in new.items():
                times.setdefault(rid, []).extend([t] * len(tokens))

        rids = drive(engine, prompts, news, arrivals, in_seconds=True, on_step=stamp)
    finally:
        torch.set_num_threads(before)
    tokens = [engine.output(r) for r in rids]
    return tokens, [entry(i, prompts[i], tokens[i], t0 + arrivals[i], times[rids[i]], 0, t0) for i in range(n)]



def summarize(timeline) -> dict:
    """TTFT (mean, p50, p90), ITL (mean, p50, p90, p99: gaps between a request's successive tokens), tokens/s (every
    output token over the span from the first arrival to the last token) and bytes moved per request."""
    ttft = np.array([r["ttft_s"] for r in timeline])
    itl = np.array([b - a for r in timeline for a, b in itertools.pairwise(r["token_s"])])
    span = max(r["token_s"][-1] for r in timeline) - min(r["arrival_s"] for r in timeline)
    nan = float("nan")
    return dict(requests=len(timeline), ttft_mean_s=float(ttft.mean()), ttft_p50_s=float(np.percentile(ttft, 50)),
                ttft_p90_s=float(np.percentile(ttft, 90)),
                itl_mean_s=float(itl.mean()) if itl.size else nan, itl_gaps=int(itl.size),
                **{f"itl_p{q}_s": float(np.percentile(itl, q)) if itl.size else nan for q in (50, 90, 99)},
                tokens_per_s=sum(r["output_tokens"] for r in timeline) / span,
                bytes_per_request=float(np.mean([r["bytes_moved"] for r in timeline])))



def measure(model, prompts, max_new_tokens, arrivals_s, prefill_pages: int = 64, decode_pages: int = 64,
            page_size: int = 16, max_batch_tokens: int = 256) -> dict:
    """The same load both ways: Disaggregated (two processes, one thread each) and colocated (one engine, two
    threads, prefill_pages + decode_pages pages: the same memory). Returns {"disaggregated": summary,
    "colocated": summary, "same_tokens": bool, "settings": ..., "timelines": {mode: timeline}}; each summary
    as `summarize`'s."""
    with tqdm(total=2, desc="prefill apart from decode: disaggregated, colocated") as bar:
        with Disaggregated(model, prefill_pages, decode_pages, page_size, max_batch_tokens) as d:
            tokens_d, timeline_d = d.generate(prompts, max_new_tokens, arrivals_s)
        bar.update()
        tokens_c, timeline_c = colocated(model, prompts, max_new_tokens, arrivals_s, prefill_pages + decode_pages,
                                         page_size, max_batch_tokens)
        bar.update()
    settings = dict(prefill_pages=prefill_pages, decode_pages=decode_pages, page_size=page_size,
                    max_batch_tokens=max_batch_tokens, threads=2, transport="pipe")
    return dict(disaggregated=summarize(timeline_d), colocated=summarize(timeline_c),
                same_tokens=tokens_d == tokens_c, settings=settings,
                timelines=dict(disaggregated=timeline_d, colocated=timeline_c))


__all__ = ["colocated", "summarize", "measure"]
