"""Record-level DP-SGD inside a client: every local step's gradient is the noised sum of per-example clipped
gradients (Abadi et al. CCS'16), whatever the rule then adds to it (SCAFFOLD's ``c − c_i``, FedProx's ``μ(y − x)``:
functions of the model and of earlier private outputs, so post-processing).

Per-example gradients come from ``torch.func`` (``vmap(grad(·))`` over the batch, the machinery fedlight's stacked
runner already uses) rather than Opacus' ``GradSampleModule``: Opacus wraps the module with hooks and its
``DPOptimizer`` owns the optimizer step, while fedlight reuses one model instance for every client and lets each rule
own its step; ``torch.func`` leaves both as they are. Opacus' accountants assume Poisson-sampled batches, which
fedlight's shuffled epochs are not, so ε comes from dp-accounting without claiming amplification by sampling.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from fedlight.algorithms.compose import ComposedClient
from fedlight.core import precision as precisions
from fedlight.core.rules import LocalUpdateRule
from fedlight.errors import ConfigError, check
from fedlight.privacy import noise

RECORD = 104
"""Stream tag of the per-step record-level noise."""


def check_rule(local: LocalUpdateRule, name: str) -> None:
    """Record-level DP needs a plain gradient step: FedAvg's, or a composed step without a perturbation."""
    plain = type(local) is LocalUpdateRule or (isinstance(local, ComposedClient) and local.perturbation is None
                                               and not local.clip_gradient_first)
    check(plain, f"`privacy.level: record` is refused for {name}: its local step is not a plain gradient step (SAM "
          "family, FedWMSAM, rules with their own step) and its private form is not defined; use privacy.level: "
          "client")


class _Objective(nn.Module):
    """``ctx.loss(model, batch)`` as a module, so ``torch.func.functional_call`` can swap the model's parameters."""

    def __init__(self, model: nn.Module, ctx) -> None:
        super().__init__()
        self.model, self.ctx = model, ctx

    def forward(self, batch: Any) -> Tensor:
        return self.ctx.loss(self.model, batch)


def private_gradient(ctx, model: nn.Module, batch: Any, sigma: float, clip: float, gen: torch.Generator) -> Tensor:
    """Leave ``(Σ_b clip_C(∇ℓ_b) + N(0, σ²C²)) / B`` in ``.grad``; returns the batch's mean loss."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ConfigError("`privacy.level: record` needs per-example gradients, which BatchNorm's batch statistics "
                          "mix; use a model with GroupNorm or no normalization")
    wrapped = _Objective(model, ctx)
    names = list(ctx.params)

    def loss_one(p: dict[str, Tensor], sample: Any) -> tuple[Tensor, Tensor]:
        one = torch.utils._pytree.tree_map(lambda t: t.unsqueeze(0), sample)
        loss = torch.func.functional_call(wrapped, {f"model.{k}": v for k, v in p.items()}, (one,))
        return loss, loss

    detached = {k: v.detach() for k, v in ctx.params.items()}
    grads, losses = torch.func.vmap(torch.func.grad(loss_one, has_aux=True), in_dims=(None, 0),
                                    randomness="different")(detached, batch)
    B = losses.shape[0]
    sq = sum(grads[k].reshape(B, -1).double().pow(2).sum(1) for k in names)
    factor = torch.clamp(clip / sq.sqrt(), max=1.0)  # per example: min(1, C/‖g_b‖)
    summed = {k: torch.einsum("b,b...->...", factor.to(grads[k].dtype), grads[k]) for k in names}
    noise.gaussian_(summed, sigma * clip, gen)
    for k, p in ctx.params.items():
        p.grad = summed[k] / B
    return losses.mean().detach()


class RecordLevel:
    """Installs :func:`private_gradient` as the client's ``ctx.forward_backward`` for one client's round."""

    def __init__(self, sigma: float, clip: float, seed: int) -> None:
        self.sigma, self.clip, self.seed = sigma, clip, seed

    def install(self, model: nn.Module, ctx) -> None:
        plugin = precisions.plugin(ctx.fabric)
        if plugin is not None and type(plugin).__name__ != "DoublePrecision":
            raise ConfigError("`privacy.level: record` runs in 32-true or 64-true precision only (per-example "
                              "gradients without loss scaling or autocast); use --precision 32-true")
        gen = noise.generator(self.seed, ctx.round, RECORD, ctx.client_id)
        ctx.forward_backward = lambda m, batch: private_gradient(ctx, m, batch, self.sigma, self.clip, gen)


def uses_per_round(data, loop) -> int:
    """How many times a record can enter a client's gradients in one round: the local epochs begun, at most."""
    def steps(c: int) -> int:
        return loop.local_steps if loop.local_steps is not None else (loop.local_epochs or 1) * data.steps_per_epoch(c)
    return max(math.ceil(steps(c) / data.steps_per_epoch(c)) for c in range(data.num_clients))
