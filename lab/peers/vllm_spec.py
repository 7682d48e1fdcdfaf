"""Run requests through vLLM with ngram (prompt lookup) speculative decoding; report greedy tokens, wall time
and vLLM's acceptance counters (JSON).

Runs under `.venv-vllm/bin/python` (made by `make vllm`), never under the lab's environment: it imports
only vLLM and the standard library. Reads a request on stdin:

    {"model": "<HF folder>", "k": 4, "n": 3, "max_tokens": 32, "prompts": [[ids], ...], "out": "<path>",
     "block_size": 32, "max_model_len": 2048}

and writes {"vllm": version, "threads": n, "k": k, "n": n, "results": [{"tokens": [...], "seconds": wall
time of the request, "drafts": d, "draft_tokens": t, "accepted_tokens": a}, ...]} to `out` (vLLM logs to
stdout). k is `num_speculative_tokens`, the tokens drafted per step; k 0 runs plain decoding in the same
kind of process, the baseline to compare speeds with (its counters are 0). n is `prompt_lookup_max`;
`prompt_lookup_min` is 1, so vLLM drafts after the longest suffix of 1 to n tokens that occurred earlier
in the sequence, as transformers' `prompt_lookup_num_tokens` falls back from n-grams to single tokens.
The counters are the request's share of vLLM's cumulative `vllm:spec_decode_*` metrics: drafts made,
tokens drafted, tokens of those accepted. The requests run one after another, without prefix caching.
"""

import json
import sys
import time

COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}


def counters(llm) -> dict:
    """vLLM's cumulative speculative counters, summed over engines (absent when k is 0: then 0)."""
    totals = dict.fromkeys(COUNTERS, 0)
    for m in llm.get_metrics():
        for key, name in COUNTERS.items():
            if m.name == name:
                totals[key] += m.value
    return totals


def main():
    import torch
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    req = json.load(sys.stdin)
    k, n = req["k"], req.get("n", 3)
    spec = (dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=n, prompt_lookup_min=1) if k
            else None)
    llm = LLM(model=req["model"], dtype="float32", enable_prefix_caching=False,
              block_size=req.get("block_size", 32), enforce_eager=True,
              max_model_len=req.get("max_model_len", 2048), seed=0,
              gpu_memory_utilization=req.get("memory_fraction", 0.2), speculative_config=spec,
              disable_log_stats=False)                          # the metrics the counters come from
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True, detokenize=False)
    results = []
    for ids in req["prompts"]:
        before = counters(llm)
        t0 = time.perf_counter()
        out = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        after = counters(llm)
        results.append({"tokens": list(out.outputs[0].token_ids), "seconds": seconds}
                       | {key: after[key] - before[key] for key in COUNTERS})
    with open(req["out"], "w") as f:
        json.dump({"vllm": __version__, "threads": torch.get_num_threads(), "k": k, "n": n, "results": results},
                  f)


if __name__ == "__main__":  # vLLM starts worker processes: the guard keeps them from running this again
    main()
