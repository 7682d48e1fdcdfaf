"""The lab's side of the vLLM comparison: send requests to `vllm_prefix.py` (prefix caching) or
`vllm_spec.py` (ngram speculative decoding) under `.venv-vllm`, read back.
(Not named vllm.py: the script beside it, run as a file, would import this module as vLLM.)

vLLM pins transformers below 5.20 and the lab pins 5.23, so vLLM runs in its own environment (`make vllm`)
and only JSON crosses between them.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def available() -> bool:
    return VLLM_PYTHON.exists()


def run(model_dir, prompts: list, block_size=32, max_tokens=32, cores=None, timeout=900) -> dict:
    """Greedy tokens, `num_cached_tokens` and wall seconds per request from vLLM with prefix caching, requests
    in order. A prompt is a list of ids, or {"ids": [...], "salt": "..."} for vLLM's `cache_salt`.

    cores: the CPU cores vLLM's engine computes on, e.g. "0-1" (VLLM_CPU_OMP_THREADS_BIND, none kept back
    for the front end); by default vLLM keeps one core for its front end and computes on the others. The
    result's "core_ids" are the cores its engine reported binding its threads to."""
    if not isinstance(block_size, int) or block_size < 1 or block_size % 32:
        raise ValueError(f"vLLM's CPU attention backend takes block sizes that are multiples of 32, "
                         f"got {block_size!r}")
    return _call("vllm_prefix.py", dict(model=str(model_dir), block_size=block_size, max_tokens=max_tokens,
                                        prompts=prompts), cores, timeout)


def run_spec(model_dir, prompts: list, k, n=3, max_tokens=32, cores=None, timeout=900) -> dict:
    """Greedy tokens, wall seconds and speculative counters (drafts, draft_tokens, accepted_tokens) per
    request from vLLM's ngram speculative decoding (`vllm_spec.py`): k tokens drafted per step by looking up
    the sequence's last 1 to n tokens earlier in it; k 0 decodes plainly, the baseline. Prompts are lists of
    ids, run in order without prefix caching; `cores` as in `run`. The first request carries warm-up."""
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k is the number of tokens drafted per step, 0 or more, got {k!r}")
    return _call("vllm_spec.py", dict(model=str(model_dir), k=k, n=n, block_size=32, max_tokens=max_tokens,
                                      prompts=prompts), cores, timeout)


def _call(script, request: dict, cores, timeout) -> dict:
    """Send `request` to `script` under .venv-vllm; its JSON answer, with the cores its engine bound to."""
    if not available():
        raise FileNotFoundError(f"{VLLM_PYTHON} is missing: run `make vllm` to build vLLM's environment")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = os.environ | ({"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"} if cores
                            else {})
        done = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name(script))], env=env,
                              input=json.dumps(request | {"out": str(out)}), capture_output=True, text=True,
                              timeout=timeout)
        log = done.stdout + done.stderr
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"vLLM failed (exit {done.returncode}):\n{log[-3000:]}")
        bound = re.search(r"core ids=\[([\d, ]*)\]", log)
        return json.loads(out.read_text()) | {"core_ids": [int(c) for c in bound[1].split(",")] if bound else None}


def lab_run(backend, prompts: list, max_tokens=32) -> list:
    """The same requests through a lab backend with `stats`, as `run` sends them to vLLM: greedy tokens,
    prompt tokens found cached, and the wall seconds of the whole request."""
    results = []
    for p in prompts:
        p = p if isinstance(p, dict) else {"ids": p}
        ids, salt, n = p["ids"], p.get("salt"), p.get("max_tokens", max_tokens)
        t0 = time.perf_counter()
        before = backend.stats["cached_tokens"]
        tokens = [int(backend.next_logits(ids, salt=salt).argmax())]
        cached = backend.stats["cached_tokens"] - before              # the prompt's call: what vLLM reports
        while len(tokens) < n:
            tokens.append(int(backend.next_logits(ids + tokens, salt=salt).argmax()))
        results.append(dict(tokens=tokens, num_cached_tokens=cached, seconds=time.perf_counter() - t0))
    return results


if __name__ == "__main__":
    print("vLLM environment:", VLLM_PYTHON if available() else "missing (make vllm)", file=sys.stderr)
