"""The lab's side of the vLLM comparison: send requests to `vllm_prefix.py` under `.venv-vllm`, read back.
(Not named vllm.py: the script beside it, run as a file, would import this module as vLLM.)

vLLM pins transformers below 5.20 and the lab pins 5.23, so vLLM runs in its own environment (`make vllm`)
and only JSON crosses between them.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def available() -> bool:
    return VLLM_PYTHON.exists()


def run(model_dir, prompts: list, block_size=32, max_tokens=32, timeout=900) -> dict:
    """Greedy tokens and `num_cached_tokens` per request from vLLM with prefix caching, requests in order."""
    if not available():
        raise FileNotFoundError(f"{VLLM_PYTHON} is missing: run `make vllm` to build vLLM's environment")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        request = dict(model=str(model_dir), block_size=block_size, max_tokens=max_tokens, prompts=prompts,
                       out=str(out))
        done = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_prefix.py"))],
                              input=json.dumps(request), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            tail = (done.stdout + done.stderr)[-3000:]
            raise RuntimeError(f"vLLM failed (exit {done.returncode}):\n{tail}")
        return json.loads(out.read_text())


def lab_run(backend, prompts: list, max_tokens=32) -> list:
    """The same requests through a lab backend with `stats`: greedy tokens and prompt tokens found cached."""
    results = []
    for ids in prompts:
        before = backend.stats["cached_tokens"]
        tokens = [int(backend.next_logits(ids).argmax())]
        cached = backend.stats["cached_tokens"] - before              # the prompt's call: what vLLM reports
        while len(tokens) < max_tokens:
            tokens.append(int(backend.next_logits(ids + tokens).argmax()))
        results.append(dict(tokens=tokens, num_cached_tokens=cached))
    return results


if __name__ == "__main__":
    print("vLLM environment:", VLLM_PYTHON if available() else "missing (make vllm)", file=sys.stderr)
