"""The roofline of a decode step: what this machine can read and compute per second, what a step must read
and compute, and so the time the step's bytes and FLOPs take at the measured rates.

A decode step of B sequences at context T reads every weight matrix once (whatever B is: the B rows of
activations share each weight as it streams past) and each sequence's cached keys and values, and does
about 2 FLOPs per weight per sequence plus attention's 4 per attended position per query feature. Its
time cannot be below either `bytes / bandwidth` or `flops / peak` at the machine's fastest rates: the roofline
(Williams, Waterman and Patterson, 2009). A benchmark only estimates those rates, so a step can beat the
estimate. A step whose measured time is close to `bytes / bandwidth` is bound by reading memory,
and only reading fewer bytes (smaller dtypes, fewer weights, a smaller cache) makes it faster.

`machine()` measures the two ceilings in one run, with torch's own operators on this process's threads:
the bandwidth of reading a buffer far larger than the caches (a sum), of copying one (read and write), and
the peak rate of a large matrix product, in float32 and bfloat16. `step_model` counts a step's bytes and
FLOPs from the model's config.
"""

import time

import torch

from .models import ModelConfig, llama

GiB = 1 << 30


def _times(rounds: int, fn, *args) -> list:
    """The seconds of each of `rounds` calls of fn(*args), after one untimed call."""
    fn(*args)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return times


def _best(rounds: int, fn, *args) -> float:
    """The fastest of `rounds` calls of fn(*args), in seconds, after one untimed call (the least disturbed
    run: a ceiling is what the machine can do, not what it does on average)."""
    return min(_times(rounds, fn, *args))


@torch.inference_mode()
def machine(buffer_bytes: int = GiB, matmul: int = 4096, rounds: int = 7) -> dict:
    """This machine's ceilings, measured now: {"read_gb_s", "copy_gb_s", "flops": {"float32", "bfloat16"}
    (GFLOP/s), "buffer_bytes", "matmul"}. read: `x.sum()` over a float32 buffer of `buffer_bytes` (far
    beyond the last-level cache, so every byte comes from memory); copy: `y.copy_(x)`, counted as two bytes
    moved per byte copied (STREAM's convention); flops: `a @ a` of `matmul` x `matmul` matrices, 2 n^3."""
    x = torch.ones(buffer_bytes // 4)
    read = buffer_bytes / _best(rounds, torch.sum, x) / 1e9
    copy = 2 * buffer_bytes / _best(rounds, torch.Tensor.copy_, torch.empty_like(x), x) / 1e9
    del x
    flops = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(matmul, matmul).to(dtype)
        flops[str(dtype).removeprefix("torch.")] = 2 * matmul**3 / _best(max(3, rounds // 2), torch.mm, a, a) / 1e9
    return {"read_gb_s": read, "copy_gb_s": copy, "flops": flops, "buffer_bytes": buffer_bytes, "matmul": matmul}


def step_model(config: ModelConfig, batch: int, context: int, weight_bytes: int | None = None) -> dict:
    """What one decode step of `batch` sequences, each attending over `context` cached positions, must read
    and compute (Llama-shaped models; every layer global): {"weight_bytes", "cache_bytes", "bytes",
    "flops"}. weight_bytes: the bytes of the matrices a step reads (by default counted from the config: the
    layers' projections and the output head, at the config's dtype; norms and one embedding row per token
    are negligible). cache_bytes: keys and values of every layer, context positions per sequence."""
    c = config
    size = torch.empty((), dtype=c.torch_dtype).element_size()
    per_layer = c.d_model * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.d_model \
        + 3 * c.d_model * c.d_ff
    matmul_params = c.n_layers * per_layer + c.vocab_size * c.d_model
    weights = matmul_params * size if weight_bytes is None else weight_bytes
    cache = 2 * c.n_layers * c.n_kv_heads * c.head_dim * context * batch * size
    flops = 2 * matmul_params * batch + 4 * c.n_layers * c.n_heads * c.head_dim * (context + 1) * batch
    return {"weight_bytes": weights, "cache_bytes": cache, "bytes": weights + cache, "flops": flops}


def bound(step: dict, ceilings: dict, dtype: str) -> dict:
    """The time a step takes at the measured rates (the roofline: a floor as far as those rates are the most the
    machine gives): {"memory_s": bytes / read bandwidth, "compute_s": flops / peak (at `dtype`), "bound_s": the
    larger, "bound_by": "memory" or "compute"}."""
    memory = step["bytes"] / (ceilings["read_gb_s"] * 1e9)
    compute = step["flops"] / (ceilings["flops"][dtype] * 1e9)
    return {"memory_s": memory, "compute_s": compute, "bound_s": max(memory, compute),
            "bound_by": "memory" if memory >= compute else "compute"}


@torch.inference_mode()
def products(weights: dict, config: ModelConfig, rounds: int = 9) -> dict:
    """One decode step's matrix products alone, for one sequence: every layer's projections (q, k and v;
    o; gate and up; down) and the output head (`llama.head`, with its norm), each on one row of random
    activations, in a step's order, through `llama.project` with the weights given (the serving engine's
    prepacked ones, to time what it runs). {"seconds": the median of `rounds` passes after one untimed,
    "bytes": the matrices' bytes}: the part of a step that reads the weights, and nothing else."""
    names = [("lm_head",)]
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        names[-1:-1] = [(p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"),
                        (p + "self_attn.o_proj",), (p + "mlp.gate_proj", p + "mlp.up_proj"), (p + "mlp.down_proj",)]
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    matrix = lambda n: head if n == "lm_head" else weights[n + ".weight"]
    rows = [torch.randn(1, 1, matrix(ns[0]).shape[1]).to(head.dtype) for ns in names]   # [1, 1, D_in] each

    def step():
        for ns, h in zip(names, rows, strict=True):
            llama.head(h, weights, config) if ns == ("lm_head",) else llama.project(h, weights, *ns)

    times = sorted(_times(rounds, step))
    nbytes = sum(matrix(n).numel() * matrix(n).element_size() for ns in names for n in ns)
    return {"seconds": times[rounds // 2], "bytes": nbytes}
