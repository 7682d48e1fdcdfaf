"""The serving engine's fast path: a step that only decodes a few sequences, in one C++ call.

`forward_cached` is the step the book teaches and the engine's reference: every other step runs through it. A
step whose every token is a decode, for at most `rows_for(dtype)` sequences, runs instead through
`lab/kernels/step.py`: all layers and the head in one OpenMP region, which reads the weights at the machine's rate
rather than waking the thread pool for every product (chapter 3 measures both). It applies to Llama-shaped models as
trained (no biases, no per-head norms, no windows) whose weights and pages share a float32 or bfloat16 dtype on the
CPU.

    fast = FusedStep.build(model, pool)      # None where it does not apply
    if fast and fast.takes(step):
        logits = fast(ids, step, state)      # [1, B, V], as forward_cached(..., logits_at=every token) gives

How many decodes the fused step should take depends on the processor more than on the model: its products read
each weight once for four sequences, in hand-written tiles, and past a few sequences oneDNN's products, blocked for
many rows, catch up. On an Intel Xeon the fused step of 16 float32 sequences was faster than the reference; on an
AMD EPYC, 1.5 times slower. `rows_for` is a default; `tune` measures both steps on this machine, at 1, 2, 4, 8 and
16 sequences, and keeps the fused one up to the largest of them at which it was no slower (the server does this
when it starts).
"""

from time import perf_counter

import torch

from ..cache.pool import PagePool
from ..kernels.cpu import _call, cpu_kernel_available
from ..kernels.step import CHUNK, ROWS
from ..models import check_ids, check_positions, forward_cached
from ..models.llama import rope_tables

AMX_ROWS = 8   # bfloat16 on a processor with AMX: oneDNN multiplies on its matrix tiles, and on an Intel Xeon the
               # reference step of 8 sequences was as fast as the kernel's (of 4: about 60% slower; of 16: 35% faster).
               # The tiles have been made faster since: tune, on an Intel Xeon with AMX, found the fused step of 16
               # faster than the reference (results.json, roofline.fused_tune): this is the default where nothing
               # is measured (ServingEngine(fast_decode=True)); the server measures (fast_decode="measure")


def rows_for(dtype) -> int:
    """How many decodes a fused step takes at most: ROWS, or AMX_ROWS for bfloat16 where the processor has AMX."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return AMX_ROWS if dtype == torch.bfloat16 and amx else ROWS


LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")   # the kernel's order


class FusedStep:
    """A decode step of up to `rows` sequences (rows_for) for `model`'s weights over the pages of `pool` or of a
    pool of the same shape (module docstring)."""

    def __init__(self, model, pool, rows: int | None = None):
        cfg, w = model.config, model.weights
        if rows is not None and not (isinstance(rows, int) and 0 <= rows <= ROWS):
            raise ValueError(f"a fused step takes 0 to {ROWS} decodes at most (the kernel's ROWS), got {rows!r}")
        self.config, self.page_size = cfg, pool.page_size
        self.rows = rows_for(pool.dtype) if rows is None else rows
        self.dtype, self.timings = pool.dtype, None     # timings: what tune measured
        # the kernel reads the weights where they lie, by address: hold the tensors, so that none is freed
        # while the engine lives (an engine whose model's weights change refuses to step: ServingEngine.step)
        self.tensors = [[w[f"model.layers.{i}.{n}.weight"] for n in LAYER] for i in range(cfg.n_layers)]
        self.layers = torch.tensor([[t.data_ptr() for t in row] for row in self.tensors], dtype=torch.int64)
        self.embed, self.norm = w["model.embed_tokens.weight"], w["model.norm.weight"]
        self.head = w.get("lm_head.weight", self.embed)
        self.shapes = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, self.head.shape[0])

    @classmethod
    def build(cls, model, pool, rows: int | None = None) -> "FusedStep | None":
        """The fast step for `model` and `pool`, taking at most `rows` decodes (default rows_for(dtype)), or None
        where it does not apply (module docstring)."""
        cfg, w = model.config, model.weights
        if cfg.arch == "gpt2" or not cfg.as_trained or pool.manager.groups != ["full"] or cfg.kv_layout[0] != \
                cfg.n_layers or any(cfg.window_of(i)[0] for i in range(cfg.n_layers)):
            return None
        needed = {f"model.layers.{i}.{n}.weight" for i in range(cfg.n_layers) for n in LAYER}
        if {n for n in w if n.startswith("model.layers.")} != needed or not cpu_kernel_available():
            return None               # biases (Qwen2), per-head norms (Qwen3), or no C++ compiler
        needed |= {"model.norm.weight", "model.embed_tokens.weight"}
        if not needed <= w.keys():
            return None
        tensors = [w[n] for n in needed]
        if any(t.device.type != "cpu" or t.dtype != pool.dtype or not t.is_contiguous() for t in tensors) or \
                pool.dtype not in (torch.float32, torch.bfloat16):
            return None
        return cls(model, pool, rows)

    def takes(self, step) -> bool:
        """Whether the planned step is for this path: every token a decode, at most `rows` of them, none read
        through a shared prefix (cascade attention stays with the reference)."""
        return step.n_tokens == len(step.decode_at) <= self.rows and not step.cascades["full"]

    @torch.inference_mode()
    def __call__(self, ids, step, state) -> torch.Tensor:
        """ids `[1, B]`, one new token per sequence, the step planned for them -> logits `[1, B, V]`; stores
        their keys and values and advances the step, as forward_cached does. state: `owner(weights, config)`."""
        cfg = self.config
        if not self.takes(step):
            raise ValueError(f"a fused step takes at most {self.rows} decodes and no shared prefix: this step plans "
                             f"{step.n_tokens} tokens, {len(step.decode_at)} of them decodes")
        step.check_model(cfg, state)
        ids = check_ids(ids, cfg)
        if ids.shape != (1, step.n_tokens):
            raise ValueError(f"ids must be [1, {step.n_tokens}], one token per planned decode, got {tuple(ids.shape)}")
        check_positions(step.positions, cfg)
        B = ids.shape[1]
        D, Hq, Hkv, Dh, F, V = self.shapes
        x = self.embed[ids[0]]                                                  # [B, D], a copy: the residual
        cos, sin = rope_tables(step.positions, Dh, cfg.rope_theta, x.dtype)     # [B, Dh] each
        k, v, slots, tables, lengths, longest = step.in_place()   # k, v [L, pages, P, Hkv, Dh]; tables [B, width]
        logits = torch.empty(B, V, dtype=x.dtype)
        _call("step", x, self.layers, cfg.n_layers, self.norm, self.head, cos, sin, k, v, k.stride(0),
              slots, tables, tables.shape[1], lengths, longest, logits, B, D, Hq, Hkv, Dh, F, V, self.page_size,
              cfg.norm_eps, CHUNK, torch.get_num_threads())
        step.stored(B)
        step.advance(B)
        return logits[None]

    # region fused_tune
    @torch.inference_mode()
    def tune(self, weights, state, sizes=(1, 2, 4, 8, ROWS), context: int = 128, rounds: int = 5) -> int:
        """Time this step and forward_cached (over `weights`, as the engine runs it) on decode steps of each of
        `sizes` sequences at about `context` positions, on a scratch pool, and take as many decodes as the
        largest size at which the fused step was no slower (the fastest of `rounds` steps each, taken in turns,
        after one of each: the fastest, as a step another process interrupted is only ever slower). Sets and
        returns `rows`; `timings`: {size: {"fused": s, "reference": s}}. state: `owner(weights, config)`, as the
        engine holds it (`engine.owner`); weights: the engine's (`engine.weights`, prepacked where it packs)."""
        sizes = tuple(sizes) if isinstance(sizes, list | tuple) else None
        if not sizes or any(type(b) is not int for b in sizes) or sorted(set(sizes)) != list(sizes) or \
                sizes[0] < 1 or sizes[-1] > ROWS:
            raise ValueError(f"sizes: increasing whole numbers of sequences from 1 to {ROWS}, got {sizes!r}")
        if type(rounds) is not int or rounds < 1 or type(context) is not int or context < 1:
            raise ValueError(f"rounds and context are whole numbers from 1, got rounds={rounds!r}, context={context!r}")
        cfg, P = self.config, self.page_size
        steps = len(sizes) * 2 * (rounds + 1)                  # positions each sequence may gain
        pool = PagePool.for_model(cfg, sizes[-1] * (-(-(context + steps) // P) + 1), P, dtype=self.dtype)
        seqs = [pool.new_id() for _ in range(sizes[-1])]
        pool.reserve([(s, context) for s in seqs])             # keys and values as the pool holds them: timing only
        ids = torch.randint(cfg.vocab_size, (1, sizes[-1]), generator=torch.Generator().manual_seed(0))

        def fused(B):
            return lambda step: self(ids[:, :B], step, state)

        def reference(B):
            return lambda step: forward_cached(ids[:, :B], weights, cfg, step, positions=step.positions, state=state,
                                               logits_at=torch.arange(B))

        def timed(B, run):
            pool.reserve([(s, 1) for s in seqs[:B]])
            step = pool.plan_step([(s, 1) for s in seqs[:B]])
            t = perf_counter()
            run(step)
            return perf_counter() - t

        rows, timings, before, self.rows = 0, {}, self.rows, sizes[-1]   # every size through this step while timing
        try:
            for B in sizes:
                runs = {"fused": fused(B), "reference": reference(B)}
                times = {k: [] for k in runs}
                for r in range(rounds + 1):
                    for k in (("fused", "reference") if r % 2 else ("reference", "fused")):
                        times[k].append(timed(B, runs[k]))
                timings[B] = {k: min(v[1:]) for k, v in times.items()}
                if timings[B]["fused"] <= timings[B]["reference"]:
                    rows = B
        except BaseException:
            self.rows = before                                  # a failed tune changes nothing
            raise
        self.rows, self.timings = rows, timings
        return rows
    # endregion
