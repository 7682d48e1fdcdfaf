"""A serving engine's throughput under a load, in this process, and vLLM's on the same requests.

`engine_throughput` sends requests, all arriving at once, through one `ServingEngine` at several levels
(the first C requests at once), and the first few one after another; each level's output tokens per
second = output tokens / wall time of one `generate`, median of `reps` runs after one warm-up run of the
same requests. `vllm_run` runs vLLM's offline `LLM.generate` over the same requests, where an environment
here holds a CUDA build of it (`lab.peers.vllm_gpu`), and says why not where none does; `vllm_values` makes
results.json's values of either.
"""

import math
import subprocess
import time

import torch

from .bench import time_call
from .engine import ServingEngine
from .kernels import triton_paged
from .models.load import smollm2_folder
from .peers import vllm_gpu
from .results import not_run, value

# The least time left in which vLLM is started at all: its start-up alone (loading, profiling the memory,
# compiling) takes tens of seconds.
VLLM_START_S = 60


@torch.inference_mode()
def engine_throughput(model, requests, levels, reps, sequential, page_size=16, max_batch_tokens=2048,
                      device="cpu", deadline=math.inf) -> dict:
    """Requests (lab.loadgen's: a prompt of ids, max_tokens new tokens each, every answer run to its length)
    through one ServingEngine on `device`: at each level C of `levels`, in the order given, the first C
    requests at once; then the first `sequential` one after another, until the deadline
    (time.perf_counter()) has passed.

    The pool holds every request at once (no preemption), and prefix caching is off: the warm-up run sends
    the same prompts, and its pages must not shorten the timed runs' prefills. Returns {"levels": {C: dict(
    time (lab.bench summary), tokens, prompt_tokens, steps (per run), mean_batch (sequences per step))},
    "sequential": dict(time, tokens, requests) or None, "preemptions", "decode_attention" (the kernel the
    engine's decode ran), "engine" (its settings)}."""
    prompts, news = [r.prompt for r in requests], [r.max_tokens for r in requests]
    num_pages = sum(-(-(len(p) + n - 1) // page_size) for p, n in zip(prompts, news, strict=True))  # all at once
    engine = ServingEngine(model, num_pages, page_size, max_batch_tokens, prefix_caching=False)
    out = {}
    for C in levels:
        if time.perf_counter() > deadline:
            break
        batch = lambda C=C: engine.generate(prompts[:C], news[:C])
        tokens = sum(map(len, batch()))                                 # the warm-up run
        steps, sizes = engine.stats["steps"], len(engine.stats["batch_sizes"])
        t = time_call(batch, warmup=0, reps=reps, device=device)
        per_step = engine.stats["batch_sizes"][sizes:]                  # sequences in each timed step
        out[C] = dict(time=t, tokens=tokens, prompt_tokens=sum(len(p) for p in prompts[:C]),
                      steps=(engine.stats["steps"] - steps) / t["n"], mean_batch=sum(per_step) / len(per_step))

    def one_after_another():
        for p, n in zip(prompts[:sequential], news[:sequential], strict=True):
            engine.generate([p], n)

    seq = None
    if time.perf_counter() <= deadline:      # warm: the levels ran first
        seq = dict(time=time_call(one_after_another, warmup=0, reps=1, device=device), tokens=sum(news[:sequential]),
                   requests=sequential)
    attention = ("Triton paged decode kernel (lab.kernels.triton_paged)"
                 if torch.device(device).type == "cuda" and triton_paged.triton is not None
                 and not triton_paged.INTERPRETED else "the version lab.kernels.decode_attention picks for CPU tensors")
    return dict(levels=out, sequential=seq, preemptions=engine.stats["preemptions"], decode_attention=attention,
                engine=dict(num_pages=num_pages, page_size=page_size, max_batch_tokens=max_batch_tokens,
                            prefix_caching=False))


def vllm_run(requests, seconds_left) -> dict:
    """vLLM's run over these requests (lab.loadgen's), float32, on the GPU: {"rate" (output tokens/s), "run",
    "requests"}, or {"why"} where it does not run (no CUDA build at hand, fewer than VLLM_START_S seconds
    left, a failure)."""
    python, found = vllm_gpu.find_vllm_cuda()
    if python is None:
        return {"why": found}
    if seconds_left < VLLM_START_S:
        return {"why": f"{found} is at hand, but the run's time limit left {seconds_left:.0f} s, too few to start it"}
    prompts, news = [q.prompt for q in requests], [q.max_tokens for q in requests]
    try:
        # half the GPU's memory: the lab's model and pool still hold theirs in this process
        r = vllm_gpu.vllm_throughput(python, smollm2_folder(), prompts, news, timeout=seconds_left,
                                     engine_args=dict(gpu_memory_utilization=0.5))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {"why": f"{found} failed to run: {e}"[:2000]}
    return {"rate": r["output_tokens"] / r["seconds"], "run": r, "requests": len(requests)}


def vllm_values(r: dict, engine: dict) -> dict:
    """vLLM's output tokens per second and its ratio to the engine's (NOT_RUN with r["why"] where it did not
    run, or where the engine's rate was not measured)."""
    if "rate" not in r:
        return {"output_tok_s": not_run(r["why"], "tok/s"), "over_engine": not_run(r["why"], "x")}
    run = r["run"]
    rate = value(r["rate"], "tok/s", requests=r["requests"], output_tokens=run["output_tokens"], version=run["vllm"],
                 note="offline LLM.generate, float32, after one warm-up run")
    return {"output_tok_s": rate, "over_engine": value(r["rate"] / engine["value"], "x")}
