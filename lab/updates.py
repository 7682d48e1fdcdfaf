"""Weights changed in place, as a trainer changes them: what an inference server's cache must notice.

A reinforcement-learning loop serves a policy, updates its weights in place between rollouts, and serves
again. `private_copy` gives the policy weights of its own; `optimizer_step` moves them by one Adam step.
Adam's first step moves every weight by exactly the learning rate (its normalized update m / sqrt(v) is
the gradient's sign when the moments start at zero), and later steps by about as much, whatever the
gradient's size. Reinforcement-learning fine-tuning of language models runs at learning rates of 1e-6 to
1e-5 (NeMo RL's GRPO example: 5e-6); SmolLM2's weight matrices have an rms of 0.05 to 0.4, so a step is a
relative change of 1e-5 to 1e-4 per element (`relative_update`): small, as a real one is.

An adapter swap changes the weights too, by more. `lora_factors` draws a LoRA adapter (Hu et al., 2021):
for each adapted matrix W `[out, in]` two factors, B `[out, r]` and A `[r, in]`, whose product B·A is a
low-rank update of W; `lora_merged` is the model with every W replaced by W + B·A, as a server that merges
an adapter into the base weights serves it.
"""

import statistics

import torch

from .models.load import Model

STEP_LR = 5e-6   # NeMo RL's GRPO example
LORA_RANK = 8                                         # r: the update B·A has rank 8
LORA_TARGETS = ("self_attn.q_proj", "self_attn.v_proj")   # the query and value projections of every layer
LORA_NORM = 0.1  # |B·A| / |W| (Frobenius) of every adapted matrix: the lab's choice of a trained adapter's size


def private_copy(model) -> Model:
    """The model with its own copy of every weight, as a trainer holds them: ordinary tensors (made outside
    inference mode, so that their version counters count in-place changes), changed without touching the
    shared model. Its manifest is the files' hash until a weight changes, then the tensors' hash."""
    with torch.inference_mode(False):
        weights = {k: v.clone() for k, v in model.weights.items()}
    return Model(model.name, model.config, weights, model.tokenizer, model.files)


def step_signs(weights, seed=0) -> dict:
    """The direction of one optimizer step: a random sign for every element of every matrix, seeded (int8)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randint(0, 2, w.shape, generator=g, dtype=torch.int8).mul_(2).sub_(1)
            for k, w in weights.items() if w.dim() == 2}


def optimizer_step(weights, signs, lr=STEP_LR):
    """Update every matrix in place as one Adam step does: each element moves by `lr`, in the direction of
    `signs`. The tensors keep their storage; their version counters move."""
    for k, s in signs.items():
        weights[k].add_(s, alpha=lr)


def relative_update(weights, signs, lr=STEP_LR) -> float:
    """The size of that step: the median over matrices of |update| / |weight| (Frobenius norms)."""
    return statistics.median(lr * s.numel() ** 0.5 / weights[k].norm().item() for k, s in signs.items())


def lora_factors(model, rank=LORA_RANK, targets=LORA_TARGETS, relative_norm=LORA_NORM,
                 seed=0) -> dict:
    """A LoRA adapter for `model` (Llama naming): {weight name: (B `[out, r]`, A `[r, in]`)} for
    the `targets` of every layer. A is drawn as LoRA initializes it, Gaussian (here N(0, 1/r)).
    B, which training moves away from zero, is drawn Gaussian and scaled so that
    |B·A| = relative_norm x |W| (Frobenius norms), the size of a trained adapter's update.
    Seeded: the same arguments give the same adapter."""
    if model.config.arch != "llama":
        raise ValueError(f"lora_factors names Llama's projections (q_proj, v_proj); "
                         f"{model.name} is {model.config.arch}")
    g = torch.Generator().manual_seed(seed)
    factors = {}
    for layer in range(model.config.n_layers):
        for target in targets:
            name = f"model.layers.{layer}.{target}.weight"
            w = model.weights[name].float()                               # [out, in]
            a = torch.randn(rank, w.shape[1], generator=g) / rank ** 0.5  # [r, in]
            b = torch.randn(w.shape[0], rank, generator=g)                # [out, r]
            b *= relative_norm * w.norm() / (b @ a).norm()
            factors[name] = (b.to(model.dtype), a.to(model.dtype))
    return factors


def lora_merged(model, factors) -> Model:
    """`model` with the adapter merged: every adapted W replaced by a new tensor W + B·A, every
    other weight shared with `model`, not copied. It has no files, so its manifest is the hash of
    its own tensors: another model for every identity check, as an adapter swap must be."""
    weights = dict(model.weights)
    for name, (b, a) in factors.items():
        weights[name] = weights[name] + b @ a               # [out, r] @ [r, in] -> [out, in]
    return Model(f"{model.name}+lora", model.config, weights, model.tokenizer)
