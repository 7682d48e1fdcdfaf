"""EvictingCache: keep at most `budget` positions per layer and KV head, and forget the rest.

Chapter 7 explains the policies: "window" (the last `budget` positions), "sinks" (StreamingLLM: the first `sinks`
plus the most recent), "h2o" (a recent `window`, half the budget by default, plus the older positions with the most
attention, summed over queries and a KV head's query heads) and "snapkv" (the last `observation` prompt queries
vote, smoothed by a pool of width `pool`, avg or max; each KV head keeps its `budget - observation` best-voted
positions and the window).

Nothing is evicted inside a forward step; `advance(T)` commits the step, then trims each layer to the budget (so a
prompt fed in one step differs from one fed token by token). SnapKV votes only in a multi-token step that overflows
the budget; later positions are protected like the observation window, and a decode overflow drops a head's
worst-voted prompt position first, then the oldest protected one.

`length` counts every token seen, so a new key is rotated at its true position. `rerotate=True` ("window" and
"sinks", Llama-family models) keeps positions contiguous instead, as StreamingLLM does: kept keys slide down and
are turned back by R(-Delta), in float64, rounded once per eviction.

crop(n) forgets the tokens from n on: only n = 0, or n from the oldest position of the recent run every head holds
on, since evicted positions cannot come back. H2O scores keep the attention the dropped queries paid.
"""

import math

import torch
import torch.nn.functional as F

from . import checks
from .base import CacheInputError, CacheStateError, KVCache, offset_causal_mask
from .concat import ConcatCache
from .quantized import check_finite

POLICIES = ("window", "sinks", "h2o", "snapkv")
POOLINGS = ("avg", "max")
INF = float("inf")


def check_arguments(config, budget, policy, sinks, window, rerotate, observation, pool, pooling):
    """Every constructor argument of EvictingCache, checked before anything is built."""
    if policy not in POLICIES:
        raise CacheInputError(f"policy must be one of {', '.join(map(repr, POLICIES))}, got {policy!r}")
    checks.int_arg("budget", budget, low=1)
    if policy == "sinks":
        checks.int_arg("sinks", sinks)
        if budget <= sinks:
            raise CacheInputError(f"budget {budget} must be larger than the {sinks} sinks: the rest of the "
                                  "budget is the recent window")
    if window is not None:
        if policy != "h2o":
            raise CacheInputError(f"window sets H2O's recent window; policy {policy!r} fixes its own (window: the "
                                  "budget, sinks: budget - sinks, snapkv: observation)")
        checks.int_arg("window", window)
        if window > budget:
            raise CacheInputError(f"window {window} must be at most the budget {budget}")
    if policy == "snapkv":
        checks.int_arg("observation", observation, low=1)
        if observation > budget:
            raise CacheInputError(f"observation window {observation} must be at most the budget {budget}: the "
                                  "observation window is always kept")
        checks.int_arg("pool", pool, low=1)
        if pool % 2 == 0:
            raise CacheInputError(f"pool must be odd (a window centred on each position), got {pool}")
        if pooling not in POOLINGS:
            raise CacheInputError(f"pooling must be one of {', '.join(map(repr, POOLINGS))}, got {pooling!r}")
    if not isinstance(rerotate, bool):
        raise CacheInputError(f"rerotate must be True or False, got {rerotate!r}")
    if rerotate and policy not in ("window", "sinks"):
        raise CacheInputError(f"rerotate=True renumbers the positions every head keeps; policy {policy!r} keeps "
                              "different positions in different heads: use 'window' or 'sinks'")
    if not config.as_trained and (policy in ("h2o", "snapkv") or rerotate
                                  or any(config.window_of(i)[0] for i in range(config.kv_layout[0]))):
        raise CacheInputError(f"a retrofitted model (chapter 10) evicts with policy 'window' or 'sinks', without "
                              f"rerotate, and has no local layers (their window is counted in positions an "
                              f"evicting cache no longer has); got policy {policy!r}, rerotate={rerotate}")
    if rerotate and config.arch != "llama":
        raise CacheInputError(f"rerotate=True turns RoPE keys back; {config.arch} has learned absolute positions, "
                              "which a stored key cannot be moved out of")


def rotate(x, delta, theta):
    """Turn the keys x `[B, H, n, D]` by delta `[n]` positions: pair (j, j + D/2) by the angle
    delta * theta^(-2j/D), RoPE's rotation (lab.models.llama.rope), in float64, rounded once."""
    D = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float64) / D)  # [D/2]
    angles = delta.to(torch.float64)[:, None] * inv_freq                                       # [n, D/2]
    angles = torch.cat([angles, angles], dim=-1)                                               # [n, D]
    x64 = x.to(torch.float64)
    x1, x2 = x64[..., : D // 2], x64[..., D // 2:]
    return (x64 * angles.cos() + torch.cat((-x2, x1), dim=-1) * angles.sin()).to(x.dtype)      # [B, H, n, D]


def gather(x, index):  # x [B, H, N, ...], index [B, H, n] -> x at those positions of each head
    if x.dim() == 3:
        return x.gather(2, index)                                                  # [B, H, n]
    return x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[-1]))           # [B, H, n, D]


class EvictingCache(ConcatCache):  # grows by concatenation, then evicts on advance
    def __init__(self, config, budget: int, policy: str = "window", batch_size: int = 1, dtype=None,
                 device="cpu", sinks: int = 4, window: int | None = None, rerotate: bool = False,
                 observation: int = 32, pool: int = 7, pooling: str = "avg"):
        check_arguments(config, budget, policy, sinks, window, rerotate, observation, pool, pooling)
        super().__init__(config, batch_size, dtype, device)
        self._args = dict(budget=budget, policy=policy, sinks=sinks, window=window, rerotate=rerotate,
                          observation=observation, pool=pool, pooling=pooling)
        self.budget, self.policy, self.rerotate = budget, policy, rerotate
        self.sinks = sinks if policy == "sinks" else 0            # StreamingLLM keeps 4
        self.window = (budget // 2 if window is None else window) if policy == "h2o" else None  # H2O: half
        self.observation, self.pool, self.pooling = observation, pool, pooling  # SnapKV: 32 queries vote
        L = self.n_layers                 # keys, values: per layer [B, H_kv, held (+ T pending), D]
        self.kept_positions = [None] * L  # per layer [B, H_kv, held] int64: each key's token, increasing
        self.scores = [None] * L          # per layer [B, H_kv, held] float32 (h2o, snapkv), else None
        self._step = [None] * L           # this step's statistics until advance: [B, H_kv, held + T] float32
        self._held = 0                    # committed positions each head holds

    @property
    def held(self) -> int:
        """Positions each layer and head holds: min(tokens seen, budget) between steps."""
        return self._held

    # region attention
    def attend(self, layer, q, k, v):
        """Store k, v and attend, as every cache does; h2o also records the attention each key received,
        and snapkv, in a step that will overflow, the votes of its observation window."""
        if self.policy == "h2o":
            return self._attend_and_score(layer, q, k, v)
        out = super().attend(layer, q, k, v)
        T = q.shape[2]
        if self.policy == "snapkv" and T > 1 and self._held + T > self.budget:
            self._step[layer] = self._votes(q, self.keys[layer])
        return out

    def _grouped_logits(self, q, keys):  # q [B, H_q, T, D], keys [B, H_kv, N, D] -> [B, H_kv, G, T, N]
        B, H_q, T, D = q.shape
        q = q.reshape(B, self.n_kv_heads, H_q // self.n_kv_heads, T, D)   # query head h uses KV head h // G
        return q @ keys[:, :, None].transpose(-1, -2) / math.sqrt(D)

    def _attend_and_score(self, layer, q, k, v):
        keys, values = self.update(layer, k, v)                   # [B, H_kv, N, D], N = held + T
        B, H_q, T, D = q.shape
        logits = self._grouped_logits(q, keys)                    # [B, H_kv, G, T, N]
        if T > 1:
            logits = logits.masked_fill(~offset_causal_mask(keys.shape[2] - T, T, q.device), -INF)
        probs = logits.float().softmax(dim=-1)                    # [B, H_kv, G, T, N]
        self._step[layer] = probs.sum(dim=(2, 3))                 # [B, H_kv, N]: received this step
        out = probs.to(values.dtype) @ values[:, :, None]         # [B, H_kv, G, T, D]
        return out.reshape(B, H_q, T, D)

    def _votes(self, q, keys):
        """SnapKV's priorities for the N held + new positions: pooled votes of the last queries, inf for the
        observation window itself. `[B, H_kv, N]` float32."""
        B, _, T, _ = q.shape
        N, obs = keys.shape[2], min(self.observation, T)
        logits = self._grouped_logits(q[:, :, T - obs:], keys)   # [B, H_kv, G, obs, N]
        logits = logits.masked_fill(~offset_causal_mask(N - obs, obs, q.device), -INF)
        votes = logits.float().softmax(dim=-1)[..., : N - obs].sum(dim=-2)       # [B, H_kv, G, N - obs]
        pool1d = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
        flat = votes.reshape(-1, 1, N - obs)                                    # [B * H_kv * G, 1, N - obs]
        pooled = pool1d(flat, self.pool, stride=1, padding=self.pool // 2).reshape(votes.shape).sum(dim=2)
        protected = torch.full((B, self.n_kv_heads, obs), INF, device=q.device)
        return torch.cat([pooled, protected], dim=-1)                           # [B, H_kv, N]
    # endregion

    # region design
    def _write(self, layer, k, v):
        check_finite(k, v)             # a NaN key would make every score it enters NaN, and the ranking noise
        super()._write(layer, k, v)

    def _commit(self, t):
        """Commit the t new positions of every layer, then evict down to the budget."""
        B, H, seen = self.batch_size, self.n_kv_heads, self._length
        new = torch.arange(seen, seen + t, device=self.device).expand(B, H, t).contiguous()  # [B, H_kv, t]
        for i in range(self.n_layers):
            old = self.kept_positions[i]
            positions = new if old is None else torch.cat([old, new], dim=-1)        # [B, H_kv, N]
            scores, keys, values = self._new_scores(i, t), self.keys[i], self.values[i]
            if positions.shape[-1] > self.budget:
                keep = self._keep(positions, scores)                                  # [B, H_kv, budget]
                keys, values, positions = gather(keys, keep), gather(values, keep), gather(positions, keep)
                scores = None if scores is None else gather(scores, keep)
                if self.rerotate:  # every head keeps the same slots: slot keep[j] slides down to slot j
                    slid = keep[0, 0] - torch.arange(self.budget, device=self.device)  # [budget]
                    keys = rotate(keys, -slid, self.config.rope_theta)
            self.keys[i], self.values[i], self.kept_positions[i], self.scores[i] = keys, values, positions, scores
        self._step = [None] * self.n_layers
        self._length, self._held = seen + t, min(self._held + t, self.budget)

    def _new_scores(self, layer, t):
        """A layer's scores after this step, for its held + t positions (None for window and sinks)."""
        old, step = self.scores[layer], self._step[layer]
        if self.policy == "h2o":
            zeros = torch.zeros(self.batch_size, self.n_kv_heads, t, device=self.device)
            grown = zeros if old is None else torch.cat([old, zeros], dim=-1)      # [B, H_kv, N]
            return grown if step is None else grown + step
        if self.policy == "snapkv":
            if step is not None:          # this step's observation window voted
                return step
            fresh = torch.full((self.batch_size, self.n_kv_heads, t), INF, device=self.device)
            return fresh if old is None else torch.cat([old, fresh], dim=-1)
        return None

    def _keep(self, positions, scores):
        """Which `budget` of the N positions each head keeps: `[B, H_kv, budget]` indices, increasing.
        Highest priority first; ties go to the more recent position."""
        N = positions.shape[-1]
        if self.policy == "window":
            priority = torch.zeros(positions.shape, device=self.device)
        elif self.policy == "sinks":
            priority = torch.where(positions < self.sinks, INF, 0.0)
        elif self.policy == "h2o":
            recent = torch.arange(N, device=self.device) >= N - self.window       # [N]
            priority = torch.where(recent, INF, scores)
        else:
            priority = scores
        # a stable sort of the reversed row puts the more recent of two equal priorities first
        order = torch.sort(priority.flip(-1), dim=-1, descending=True, stable=True).indices
        return (N - 1 - order[..., : self.budget]).sort(dim=-1).values

    def _truncate(self, n):
        drop = self._length - n           # committed positions n .. length-1, all held (crop checked)
        keep = self._held - drop if n else 0
        for i in range(self.n_layers):
            for store in (self.keys, self.values, self.kept_positions, self.scores):
                if store[i] is not None:
                    store[i] = store[i][:, :, :keep].clone() if keep else None
        self._step = [None] * self.n_layers
        self._length, self._held = n, keep

    def fork(self):
        """An independent cache that shares the parent's tensors (no step writes into a tensor: every
        change builds a new one)."""
        checks.between_steps(self, "fork")
        child = EvictingCache(self.config, batch_size=self.batch_size, dtype=self.dtype, device=self.device,
                              **self._args)
        for name in ("keys", "values", "kept_positions", "scores"):
            setattr(child, name, list(getattr(self, name)))
        child._held = self._held
        return self._copy_state_to(child)

    def kept_map(self, layer: int, length: int, row: int = 0) -> torch.Tensor:
        """Which original positions each KV head of `layer` holds: bool `[H_kv, length]`."""
        kept = self.kept_positions[layer][row]                                    # [H_kv, held]
        return torch.zeros(kept.shape[0], length, dtype=torch.bool).scatter_(1, kept, True)
    # endregion

    # region positions
    def next_positions(self, T: int, device=None) -> torch.Tensor:
        """The positions the next T tokens are rotated at: their true positions (tokens seen), or with
        rerotate the slots after the held ones."""
        if not self.rerotate:
            return super().next_positions(T, device)
        return torch.arange(self._held, self._held + T, device=device)              # [T]

    def crop(self, n: int):
        """Forget the tokens from n on: n = 0, or only positions every head still holds (see the module)."""
        checks.crop(self, n)
        lowest = self.lowest_crop()
        if n and n < lowest:
            raise CacheStateError(f"crop({n}): position {lowest - 1} was evicted; an evicting cache drops only "
                                  f"positions it still holds: n must be 0 or in {lowest}..{self._length}")
        super().crop(n)

    def lowest_crop(self) -> int:
        """The smallest n > 0 that crop(n) takes: the oldest position of the recent run every head holds."""
        seen, held = self._length, self._held
        if not held:
            return seen
        run = torch.arange(seen - held, seen, device=self.device)     # the positions of an unbroken tail
        tails = [(p == run).sum(dim=-1).min().item() for p in self.kept_positions]  # positions are increasing
        return seen - min(tails)

    @KVCache.length.setter
    def length(self, n):  # KVCache's getter: tokens seen (those held: `held`)
        raise CacheStateError("an evicting cache's length is the number of tokens it has seen; it cannot be set")
    # endregion
