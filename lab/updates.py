"""Weights changed in place, as a trainer changes them: what an inference server's cache must notice.

A reinforcement-learning loop serves a policy, updates its weights in place between rollouts, and serves
again. `private_copy` gives the policy weights of its own; `optimizer_step` moves them by one Adam step.
Adam's first step moves every weight by exactly the learning rate (its normalized update m / sqrt(v) is
the gradient's sign when the moments start at zero), and later steps by about as much, whatever the
gradient's size. Reinforcement-learning fine-tuning of language models runs at learning rates of 1e-6 to
1e-5 (NeMo RL's GRPO example: 5e-6); SmolLM2's weight matrices have an rms of 0.05 to 0.4, so a step is a
relative change of 1e-5 to 1e-4 per element (`relative_update`): small, as a real one is.
"""

import statistics

import torch

from .models.load import Model

STEP_LR = 5e-6   # NeMo RL's GRPO example


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
