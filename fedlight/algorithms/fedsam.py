"""FedSAM (Qu et al. 2022, "Generalized Federated Learning via Sharpness Aware Minimization";
Caldarola et al. 2022, "Improving Generalization in Federated Learning by Seeking Flat Minima").

Client: SAM steps (Foret et al. 2021). Two backprops per step:
  g  = ∇ℓ(y)                       (BatchNorm running statistics updated here, once per step)
  e  = ρ·g/(‖g‖ + 1e-12)           (joint norm over all parameters)
  d  = g' = ∇ℓ(y + e)              (running statistics frozen)
then y is restored and the step uses ``d``. Server: FedAvg. ``ρ = 0`` is FedAvg.
Refuses ``16-mixed`` precision: loss scaling corrupts ‖g‖.
"""

from __future__ import annotations

from fedlight.algorithms.compose import ComposedClient, Perturbation
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


class SAMPerturbation(Perturbation):
    """``e = ρ·g/(‖g‖ + 1e-12)`` from the gradient at ``y`` (one extra backprop)."""

    uses_backprop = True

    def __init__(self, rho: float) -> None:
        self.rho = rho

    def __call__(self, model, batch, ctx):
        loss = ctx.forward_backward(model, batch)  # g = ∇ℓ(y)
        e = self.direction(ctx.grads(), ctx)
        ctx.metrics["perturbation_norm"] = P.norm(e)
        return e, loss

    def direction(self, g, ctx):
        """``ρ·g/(‖g‖ + 1e-12)``; overridden by ASAM."""
        return P.scale(P.unit(g, eps=1e-12), self.rho)


@register("fedsam", paper="Qu et al., ICML 2022; Caldarola et al., ECCV 2022", backprops=2, comm=(1, 1))
class FedSAM(Algorithm):
    """FedSAM.

    Args:
        rho: ρ, SAM radius (≥ 0; 0 is FedAvg). The papers' tables use 0.01–0.1.
        server_lr: η_g.
    """

    def __init__(self, rho: float = 0.05, server_lr: float = 1.0) -> None:
        check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")
        super().__init__(ComposedClient(SAMPerturbation(rho)), ServerRule(server_lr))
