"""Cascade attention against the paged kernel on the CPU: n branches of one prompt, one decode step.

`cascade_case(n, shared, dtype)` times one decode attention for n branches over a shared prefix of
`shared` positions, each branch with 64 to 256 positions of its own, in SmolLM2-135M's shape (9 query heads,
3 kv heads, head size 64), pages of 16 scattered at random in the pool: `cascade_attention` (the C++
`cascade_attention_cpu`, the shared pages read once for all branches) against `decode_attention` (the C++
`paged_attention_cpu`) over each branch's full table, the shared pages then its own. Both skip the host-side
value checks, as a serving step does. Times are medians of rounds that alternate the two (lab.bench's
time_rounds), warm-up excluded, on torch's threads; the caches are warm: what one call reads is in the
processor's caches for the next (this machine's last-level cache may hold every page).

Bytes read are the keys and values each kernel asks for: the shared pages once plus each branch's own for
the cascade, the shared pages once per branch for the paged kernel. Throughput is branch-tokens per second
(n tokens decoded per call / the call's time); attended positions per second, n * (shared + own) / time,
show how each kernel's rate holds as the prefix grows. `cascade_bench` runs the grid; `table` prints it.
"""

import torch

from .bench import time_rounds
from .kernels import cascade_attention, cpu_kernel_available, decode_attention

HEADS, HEAD_DIM, PAGE_SIZE = (9, 3), 64, 16     # SmolLM2-135M's attention; pages of 16 as chapter 5's cache


def cascade_inputs(n, shared, dtype=torch.float32, page_size=PAGE_SIZE, own=(64, 256), seed=0) -> dict:
    """One case's inputs: q [n, H_q, D]; pools [pages, page_size, H_kv, D] of random values, their pages handed
    out in random order; shared_table int32 [shared / page_size] (shared a multiple of page_size); own tables
    int32 [n, max own pages] and lengths int32 [n] drawn from `own`; and the full tables [n, all pages] and
    lengths [n] the paged kernel reads."""
    (H_q, H_kv), D = HEADS, HEAD_DIM
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(own[0], own[1] + 1, (n,), generator=g, dtype=torch.int32)    # [n]
    S, O = shared // page_size, -(-own[1] // page_size)                                  # pages: shared, own
    ids = torch.randperm(S + n * O, generator=g).to(torch.int32)
    shared_table, tables = ids[:S], ids[S:].view(n, O)                                   # [S], [n, O]
    draw = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    pools = [draw(S + n * O, page_size, H_kv, D) for _ in range(2)]                     # k, v
    full = torch.cat([shared_table.expand(n, S), tables], dim=1)                         # [n, S + O]
    return dict(q=draw(n, H_q, D), k_pool=pools[0], v_pool=pools[1], shared_table=shared_table, shared=shared,
                tables=tables, lengths=lengths, full=full, full_lengths=lengths + shared)


def cascade_case(n, shared, dtype=torch.float32, warmup=2, rounds=15, seed=0) -> dict:
    """Time one case (cascade_inputs' arguments): both kernels' median milliseconds, bytes read, branch-tokens
    and attended positions per second, and the largest difference between their outputs."""
    if not cpu_kernel_available():
        raise RuntimeError("the C++ kernels did not build here (see lab/kernels/cpu.py): nothing to compare")
    x = cascade_inputs(n, shared, dtype, seed=seed)
    pools = (x["q"], x["k_pool"], x["v_pool"])
    own_max, full_max = int(x["lengths"].max()), int(x["full_lengths"].max())
    fns = {"cascade": lambda: cascade_attention(*pools, x["shared_table"], shared, x["tables"], x["lengths"],
                                                check_values=False, max_length=own_max),
           "paged": lambda: decode_attention(*pools, x["full"], x["full_lengths"], check_values=False,
                                             max_length=full_max)}
    diff = (fns["cascade"]().float() - fns["paged"]().float()).abs().max().item()
    times = time_rounds(fns, warmup, rounds)
    row_bytes = 2 * HEADS[1] * HEAD_DIM * x["k_pool"].element_size()                   # k and v of a position
    own = int(x["lengths"].sum())
    read = {"cascade": (shared + own) * row_bytes, "paged": (n * shared + own) * row_bytes}
    out = dict(n=n, shared=shared, dtype=str(dtype).removeprefix("torch."), own=own, max_abs_diff=diff,
               threads=torch.get_num_threads())
    for name, t in times.items():
        s = t["median"]
        out |= {f"{name}_ms": s * 1e3, f"{name}_iqr_ms": t["iqr"] * 1e3, f"{name}_MB": read[name] / 1e6,
                f"{name}_branch_tokens_per_s": n / s, f"{name}_positions_per_s": (n * shared + own) / s}
    return out | dict(speedup=out["paged_ms"] / out["cascade_ms"])


def cascade_bench(branches=(1, 4, 16), shared=(1024, 4096, 16384), dtypes=(torch.float32, torch.bfloat16),
                  **case) -> list[dict]:
    """cascade_case over the grid: every dtype, branch count and shared length."""
    return [cascade_case(n, s, dtype, **case) for dtype in dtypes for n in branches for s in shared]


def table(rows) -> str:
    """The rows as a markdown table: times, bytes, throughputs (k: thousands, M: millions per second)."""
    head = ("| dtype | n | shared | cascade ms | paged ms | speedup | cascade MB | paged MB | cascade tok/s "
            "| paged tok/s | cascade Mpos/s | paged Mpos/s |\n|" + "---|" * 12)
    lines = [f"| {r['dtype']} | {r['n']} | {r['shared']} | {r['cascade_ms']:.3g} | {r['paged_ms']:.3g} | "
             f"{r['speedup']:.2f} | {r['cascade_MB']:.3g} | {r['paged_MB']:.3g} | "
             f"{r['cascade_branch_tokens_per_s']:.0f} | {r['paged_branch_tokens_per_s']:.0f} | "
             f"{r['cascade_positions_per_s'] / 1e6:.0f} | {r['paged_positions_per_s'] / 1e6:.0f} |" for r in rows]
    return "\n".join([head, *lines])
