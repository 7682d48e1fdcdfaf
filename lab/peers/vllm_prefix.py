"""Run requests through vLLM with prefix caching; report greedy tokens and cached-token counts (JSON).

Runs under `.venv-vllm/bin/python` (made by `make vllm`), never under the lab's environment: it imports
only vLLM and the standard library. Reads a request on stdin:

    {"model": "<HF folder>", "block_size": 32, "max_tokens": 32, "prompts": [[ids] or {"ids": [ids],
     "salt": "<cache_salt>", "max_tokens": n}, ...], "out": "<path>"}

and writes {"vllm": version, "threads": n, "results": [{"tokens": [...], "num_cached_tokens": n,
"seconds": wall time of the request}, ...]} to `out` (vLLM logs to stdout). A prompt's own max_tokens
replaces the request's. With max_tokens 1 a request's wall time is its time to first token, as a caller
sees it. The requests run one after another, so each sees the cache the previous ones left (as the
lab's backend does). On the CPU backend `gpu_memory_utilization` is the fraction of the host's memory
vLLM takes for its KV cache; it refuses to start if that much is not free, so a small fraction is asked.
"""

import json
import sys
import time


def main():
    import torch
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    req = json.load(sys.stdin)
    llm = LLM(model=req["model"], dtype="float32", enable_prefix_caching=True, block_size=req["block_size"],
              enforce_eager=True, max_model_len=req.get("max_model_len", 2048), seed=0,
              gpu_memory_utilization=req.get("memory_fraction", 0.2))
    results = []
    for p in req["prompts"]:
        p = p if isinstance(p, dict) else {"ids": p}
        params = SamplingParams(temperature=0.0, max_tokens=p.get("max_tokens", req["max_tokens"]), ignore_eos=True,
                                detokenize=False)
        prompt = TokensPrompt(prompt_token_ids=p["ids"])
        if p.get("salt") is not None:
            prompt["cache_salt"] = p["salt"]
        t0 = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        results.append({"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
                        "seconds": seconds})
    with open(req["out"], "w") as f:
        json.dump({"vllm": __version__, "threads": torch.get_num_threads(), "results": results}, f)


if __name__ == "__main__":  # vLLM starts worker processes: the guard keeps them from running this again
    main()
