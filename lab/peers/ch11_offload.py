"""A multi-turn trace through vLLM with its KV cache offloaded below the GPU: vLLM's native CPU offloading
(`--kv-offloading-backend native --kv-offloading-size GiB`), LMCache's connector (`--kv-transfer-config
'{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'`, its CPU tier set by LMCACHE_* variables), or
neither (the baseline); per request the prompt tokens found cached and the time to first token (JSON).

Runs under the Python of an environment that holds vLLM's CUDA build (the GPU script finds it with
`lab.peers.vllm_gpu.find_vllm_cuda`), never under the lab's: it imports only vLLM and the standard library.
On this CPU-only machine neither tier starts (research/ch11/real_systems.md has the errors). Reads a request
file (argv[1]):

    {"model": "<HF folder>", "mode": "baseline" | "native" | "lmcache", "offload_gib": 2.0,
     "num_gpu_blocks": 160, "block_size": 16, "max_model_len": 2048, "prompts": [[ids], ...], "out": "<path>"}

and writes {"vllm": version, "mode", "lmcache": version or null, "results": [{"num_cached_tokens",
"prompt_tokens", "ttft_s"}, ...]}. `num_gpu_blocks` caps the GPU's pool below what the trace's prefixes need,
so that a prefix comes back either from the tier below or by computing it again. Each request asks for one
token, so its wall time is its time to first token; the requests run one after another, in order, after one
warm-up request that shares no prefix with them.
"""

import json
import os
import sys
import time


def main():
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    req = json.load(open(sys.argv[1]))
    mode, lmcache = req["mode"], None
    args = dict(model=req["model"], dtype="float32", seed=0, enforce_eager=True, enable_prefix_caching=True,
                block_size=req["block_size"], max_model_len=req["max_model_len"],
                num_gpu_blocks_override=req["num_gpu_blocks"], gpu_memory_utilization=0.5)
    if mode == "native":
        args |= dict(kv_offloading_backend="native", kv_offloading_size=req["offload_gib"])
    elif mode == "lmcache":
        import importlib.metadata

        from vllm.config import KVTransferConfig
        lmcache = importlib.metadata.version("lmcache")
        os.environ |= {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": str(req["offload_gib"]),
                       "LMCACHE_CHUNK_SIZE": "256"}
        args |= dict(kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both"))
    elif mode != "baseline":
        raise ValueError(f"mode is baseline, native or lmcache, got {mode!r}")
    llm = LLM(**args)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate(TokensPrompt(prompt_token_ids=[7] * 64), params, use_tqdm=False)      # warm-up
    results = []
    for ids in req["prompts"]:
        t0 = time.perf_counter()
        out = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0]
        results.append(dict(ttft_s=time.perf_counter() - t0, prompt_tokens=len(ids),
                            num_cached_tokens=out.num_cached_tokens))
    with open(req["out"], "w") as f:
        json.dump(dict(vllm=__version__, mode=mode, lmcache=lmcache, results=results), f)


def run(python, request: dict, timeout: float) -> dict:
    """The lab's side: this file run by `python` (an environment with vLLM's CUDA build) on `request` (the
    fields above, less "out"); its JSON answer. Raises RuntimeError with the end of vLLM's log if it fails."""
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        path.write_text(json.dumps(request | {"out": str(out)}))
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                            "DO_NOT_TRACK": "1"}
        env.pop("PYTHONPATH", None)           # vLLM's environment imports nothing of the lab's
        done = subprocess.run([str(python), __file__, str(path)], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"vLLM failed (exit {done.returncode}): {(done.stdout + done.stderr)[-1500:]}")
        return json.loads(out.read_text())


if __name__ == "__main__":  # vLLM starts worker processes: the guard keeps them from running this again
    main()
