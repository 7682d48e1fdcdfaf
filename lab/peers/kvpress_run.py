"""Score continuations on a context cache that a kvpress press compressed; report the loss (JSON).

Runs under `.venv-peers/bin/python` (made by `make peers`), never under the lab's environment: it imports
only kvpress, transformers, torch and the standard library. Reads a request on stdin:

    {"model": "<HF folder>", "press": "streaming_llm" | "snapkv" | "knorm" | "none",
     "compression_ratio": 0.5,          # the fraction of the context's key/value pairs removed ("none": unused)
     "n_sink": 4,                       # StreamingLLM: first positions always kept (optional)
     "window_size": 64,                 # SnapKV: the last context positions whose queries vote (optional)
     "kernel_size": 5,                  # SnapKV: width of the pooling over the votes (optional)
     "rerotate": false,                 # wrap the press in KeyRerotationPress (optional, see below)
     "threads": null,                   # torch threads (optional; torch's default otherwise)
     "contexts": [[ids], ...], "continuations": [[ids], ...], "out": "<path>"}

and writes {"kvpress": version, "transformers": version, "torch": version, "threads": n,
"load_seconds": s, "results": [{"loss": ..., "kl": ..., "tokens": n, "cache_length": n, "kept": ...,
"seconds": s}, ...]} to `out`, one result per (context, continuation) pair, in order.

The protocol is kvpress's own (README, and `KVPressTextGenerationPipeline` in kvpress/pipeline.py):

1. Prefill the context under the press, `with press(model): model(context, past_key_values=cache,
   logits_to_keep=1)` (the pipeline calls `model.model`, the same forward without the head). The press's
   hook runs after each attention layer and replaces that layer's cached keys and values by the ones it
   keeps; the layer's output was already computed over the whole context. So the context's hidden states,
   and its last logits, are exactly the uncompressed model's.
2. Score the continuation c[0..n-1] on that cache, outside the press (nothing more is compressed):
   - c[0] from the last context position's logits (step 1; unaffected by the press);
   - c[1..n-1] from the logits of feeding c[0..n-2] on the compressed cache, with `position_ids` that
     continue the context's own numbering, len(context) + i, as kvpress's pipeline does for a question.
   "loss" is the mean of the n values -log p(c[i] | context, c[:i]), in nats; "tokens" is n. "kl" is the mean
   over the same n positions of KL(uncompressed || compressed), in nats, the uncompressed distributions from
   one plain forward over context + c[:n-1] in the same process. With press
   "none" it is the plain model's loss on context + continuation, restricted to the continuation.

The kept keys keep the rotation of their original positions (kvpress's default). With "rerotate": true
the press is wrapped in `KeyRerotationPress`, which re-rotates the kept keys to positions 0..k-1, and the
continuation is numbered from k, the compressed length (again as the pipeline does): StreamingLLM as its
paper describes it, positions counted inside the cache.

"kept": for each layer, for each KV head, the context positions the press kept, ascending (the press's own
scores and `compute_n_kept`, the same top-k it prunes with); null for "none". "cache_length" is the
number of positions per layer after compression. "seconds" is the wall time of steps 1 and 2.
float32, CPU, no sampling, no dropout: the same request on the same machine and thread count gives the same
numbers.
"""

import contextlib
import json
import sys
import time


def make_press(req):
    """The kvpress press the request names, or None for "none"."""
    from kvpress import KnormPress, SnapKVPress, StreamingLLMPress

    name, ratio = req["press"], float(req.get("compression_ratio", 0.0))
    if name == "none":
        return None
    if name == "streaming_llm":
        press = StreamingLLMPress(compression_ratio=ratio, n_sink=req.get("n_sink", 4))
    elif name == "snapkv":
        press = SnapKVPress(compression_ratio=ratio, window_size=req.get("window_size", 64),
                            kernel_size=req.get("kernel_size", 5))
    elif name == "knorm":
        press = KnormPress(compression_ratio=ratio)
    else:
        raise ValueError(f"unknown press {name!r}: streaming_llm, snapkv, knorm or none")
    return press


def record_kept(press, kept: dict):
    """Wrap `press.score` so that each layer's kept positions land in `kept[layer]`: the top
    `compute_n_kept` scores, the same selection the press prunes with (ScorerPress.compress)."""
    from kvpress.utils import compute_n_kept

    score = press.score

    def scoring(module, hidden_states, keys, *args, **kwargs):
        scores = score(module, hidden_states, keys, *args, **kwargs)      # [B, H_kv, T]
        n = compute_n_kept(keys.shape[2], press.compression_ratio)
        kept[module.layer_idx] = scores.topk(n, dim=-1).indices[0].sort(dim=-1).values.tolist()
        return scores

    press.score = scoring


def score_one(model, press, rerotate, kept, context, continuation):
    import torch
    from transformers import DynamicCache

    ctx = torch.tensor([context])                                         # [1, T]
    cont = torch.tensor([continuation])                                   # [1, n]
    cache = DynamicCache()
    kept.clear()
    t0 = time.perf_counter()
    with torch.inference_mode():
        with press(model) if press is not None else contextlib.nullcontext():
            last = model(ctx, past_key_values=cache, logits_to_keep=1).logits[:, -1:]   # [1, 1, V]
        cache_length = cache.get_seq_length()
        first = cache_length if rerotate else ctx.shape[1]                # the continuation's first position
        logits = [last]
        if cont.shape[1] > 1:
            positions = torch.arange(first, first + cont.shape[1] - 1)[None]            # [1, n-1]
            logits.append(model(cont[:, :-1], past_key_values=cache, position_ids=positions).logits)
        logits = torch.cat(logits, dim=1)[0]                              # [n, V]
        nll = torch.nn.functional.cross_entropy(logits.float(), cont[0], reduction="mean")
        seconds = time.perf_counter() - t0
        # the same positions without the press: one forward over context + continuation, no cache
        whole = torch.cat([ctx, cont[:, :-1]], dim=1)
        reference = model(whole, logits_to_keep=cont.shape[1]).logits[0].double().log_softmax(-1)   # [n, V]
        kl = (reference.exp() * (reference - logits.double().log_softmax(-1))).sum(-1).mean()
    return dict(loss=float(nll), kl=float(kl), tokens=int(cont.shape[1]), cache_length=int(cache_length),
                kept=[kept[i] for i in sorted(kept)] if kept else None, seconds=seconds)


def main():
    from importlib.metadata import version

    import torch
    import transformers
    from kvpress import KeyRerotationPress
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()                                        # no bar per weight in the log
    req = json.load(sys.stdin)
    if req.get("threads"):
        torch.set_num_threads(int(req["threads"]))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=torch.float32).eval()
    load_seconds = time.perf_counter() - t0
    press = make_press(req)
    rerotate = bool(req.get("rerotate")) and press is not None
    kept = {}
    if press is not None and press.compression_ratio > 0:
        record_kept(press, kept)
    if rerotate:
        press = KeyRerotationPress(press=press)
    contexts, continuations = req["contexts"], req["continuations"]
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    results = [score_one(model, press, rerotate, kept, c, x) for c, x in zip(contexts, continuations, strict=True)]
    with open(req["out"], "w") as f:
        json.dump({"kvpress": version("kvpress"),
                   "transformers": transformers.__version__, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "load_seconds": load_seconds, "results": results}, f)


if __name__ == "__main__":
    main()
