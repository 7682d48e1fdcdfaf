"""The lab's prefix cache against vLLM's on one sequence of requests (chapter 6): the same ids through the
lab's PrefixCachingBackend and through vLLM (`compare_vllm`, in its own environment), pages and blocks of
32 positions: tokens cached per request, identical answers, time to first token on a hit and a miss.
"""

import numpy as np
import torch

from .. import data
from ..cache import make_cache
from ..engine import CachedBackend, PrefixCachingBackend, generate
from ..models.load import smollm2_folder
from . import compare_vllm


def vllm_requests(model, max_tokens=32, prefix=512, rounds=6) -> list:
    """One request sequence for both systems (page and block size 32):
    - a shared 70-token prefix with two tails, then the first request again (the tails and the repeat find
      the shared whole pages);
    - a 96-token prompt (three whole pages) twice: a fully matched prompt still runs its last token, so the
      repeat finds two pages, not three;
    - the first request's prompt and reply, then a new message: pages filled while decoding are cached too;
    - a `prefix`-token prompt with a 16-token question, warmed, then in turns the same (hit) and under a new
      cache salt (miss), max_tokens 1: their seconds are times to first token."""
    ps = data.passages(model.tokenizer, prefix + 16, count=5, seed=3)
    shared = ps[0][:70]
    first = shared + ps[1][:20]
    out = [first, shared + ps[2][:45], first, ps[3][:96], ps[3][:96]]
    reply = _greedy(model, first, max_tokens)
    out.append(first + reply + ps[2][50:70])
    long = ps[4]
    out.append({"ids": long, "max_tokens": 1, "role": "warm"})
    for i in range(rounds):
        out += [{"ids": long, "max_tokens": 1, "role": "hit"},
                {"ids": long, "max_tokens": 1, "salt": f"miss-{i}", "role": "miss"}]
    return out


def _greedy(model, ids, n):
    """The lab's greedy continuation of ids: n new token ids."""
    return generate(CachedBackend(model, lambda: make_cache("concat", model.config, len(ids) + n)), ids, n).tokens


@torch.inference_mode()
def against_vllm(model, max_tokens=32, prefix=512, rounds=6, cores="0-1") -> dict:
    """The same requests through the lab (page size 32) and vLLM (block size 32, prefix caching on, its
    engine bound to `cores`), one after another on this machine: per request, cached tokens, tokens and
    seconds; summaries of time to first token on a hit and a miss."""
    requests = vllm_requests(model, max_tokens, prefix, rounds)
    send = [{k: v for k, v in r.items() if k != "role"} if isinstance(r, dict) else r for r in requests]
    theirs = compare_vllm.run(smollm2_folder(), send, block_size=32, max_tokens=max_tokens, cores=cores)
    ours = compare_vllm.lab_run(PrefixCachingBackend(model, 256, 32), send, max_tokens)
    roles = [r.get("role", "agreement") if isinstance(r, dict) else "agreement" for r in requests]

    def ttft(results, role):
        return float(np.median([r["seconds"] for r, x in zip(results, roles, strict=True) if x == role]))

    agree = [i for i, x in enumerate(roles) if x == "agreement"]
    return dict(
        vllm=theirs["vllm"], core_ids=theirs["core_ids"], lab_threads=torch.get_num_threads(),
        cached_lab=[ours[i]["num_cached_tokens"] for i in agree],
        cached_vllm=[theirs["results"][i]["num_cached_tokens"] for i in agree],
        prompt_tokens=[len(requests[i]) for i in agree],
        tokens_identical=all(ours[i]["tokens"] == theirs["results"][i]["tokens"] for i in agree),
        ttft={side: {role: ttft(res, role) for role in ("hit", "miss")}
              for side, res in (("lab", ours), ("vllm", theirs["results"]))},
        timing_cached={side: res[roles.index("hit")]["num_cached_tokens"]
                       for side, res in (("lab", ours), ("vllm", theirs["results"]))},
        prefix=prefix + 16, rounds=rounds, max_tokens=max_tokens)
