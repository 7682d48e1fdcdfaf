"""The lab's side of the kvpress comparison: send contexts and continuations to `kvpress_run.py` under
`.venv-peers`, read back the continuation's loss on the compressed context cache.

kvpress 0.5.5 wants transformers below 5.3 and the lab pins 5.23, so kvpress runs in its own environment
(`make peers`) and only JSON crosses between them.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
PRESSES = ("streaming_llm", "snapkv", "knorm", "none")


def available() -> bool:
    return PEERS_PYTHON.exists()


def run(model_dir, press: str, compression_ratio: float, contexts: list, continuations: list, timeout=900,
        threads=None, **press_kwargs) -> dict:
    """Per (context, continuation) pair, the mean next-token loss (nats) of the continuation on the
    context's cache as kvpress's `press` left it after prefill, at `compression_ratio` (the fraction of
    the context's key/value pairs removed). press_kwargs go to the press: n_sink (StreamingLLM),
    window_size and kernel_size (SnapKV); rerotate=True wraps the press in KeyRerotationPress. How the loss
    is counted is in `kvpress_run.py`'s docstring.

    Returns {"kvpress", "transformers", "torch", "threads", "load_seconds", "results": [{"loss", "kl", "tokens",
    "cache_length", "kept", "seconds"}, ...]}; "kept" is, per layer and KV head, the context positions kept."""
    if press not in PRESSES:
        raise ValueError(f"press must be one of {', '.join(PRESSES)}, got {press!r}")
    if not 0 <= compression_ratio < 1:
        raise ValueError(f"compression_ratio is the fraction removed, in [0, 1), got {compression_ratio!r}")
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    if not available():
        raise FileNotFoundError(f"{PEERS_PYTHON} is missing: run `make peers` to build kvpress's environment")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        request = dict(model=str(model_dir), press=press, compression_ratio=compression_ratio,
                       contexts=[[int(i) for i in c] for c in contexts],
                       continuations=[[int(i) for i in c] for c in continuations], threads=threads, out=str(out),
                       **press_kwargs)
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        done = subprocess.run([str(PEERS_PYTHON), str(Path(__file__).with_name("kvpress_run.py"))], env=env,
                              input=json.dumps(request), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            log = done.stdout + done.stderr
            raise RuntimeError(f"kvpress failed (exit {done.returncode}):\n{log[-3000:]}")
        return json.loads(out.read_text())


if __name__ == "__main__":
    print("kvpress environment:", PEERS_PYTHON if available() else "missing (make peers)", file=sys.stderr)
