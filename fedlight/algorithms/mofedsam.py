"""MoFedSAM (Qu et al. 2022, "Generalized Federated Learning via Sharpness Aware Minimization", ICML).

FedCM with the SAM gradient. Two backprops per step:
  g  = ∇ℓ(y);   e = ρ·g/(‖g‖ + 1e-12)               (SAM ascent, BatchNorm statistics updated here once)
  g' = ∇ℓ(y + e)                                     (running statistics frozen)
  d  = α·g' + (1 − α)·G                              (FedCM's mix with the server's last pseudo-gradient)
Server: ``x ← x + η_g·Δ̄``; ``G ← −Δ̄/(K·η_r)`` (zeros in round 0). Built from :class:`SAMPerturbation`,
:class:`~fedlight.algorithms.fedcm.MomentumCorrection` and :class:`~fedlight.algorithms.fedcm.PseudoGradientServer`.
``α = 1`` is FedSAM, ``ρ = 0`` is FedCM. Defaults α = 0.1, ρ = 0.1 (the seed papers' tables, and the released
FL-Simulator code). Refuses ``16-mixed`` precision (SAM needs the true ‖g‖).
"""

from __future__ import annotations

from fedlight.algorithms.compose import ComposedClient
from fedlight.algorithms.fedcm import MomentumCorrection, PseudoGradientServer, check_alpha
from fedlight.algorithms.fedsam import SAMPerturbation
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


@register("mofedsam", paper="Qu et al., ICML 2022", backprops=2, comm=(2, 1))
class MoFedSAM(Algorithm):
    """MoFedSAM: FedCM momentum with SAM local gradients.

    Local step ``d = α·∇ℓ(y + e) + (1 − α)·G`` with the SAM offset ``e``. Download ``x_r`` and ``G`` (2),
    upload ``Δ_i`` (1).

    Args:
        alpha: α, the weight of the local SAM gradient (0 < α ≤ 1; 1 is FedSAM).
        rho: ρ, SAM radius (≥ 0; 0 is FedCM).
        server_lr: η_g.
    """

    def __init__(self, alpha: float = 0.1, rho: float = 0.1, server_lr: float = 1.0) -> None:
        check_alpha(alpha)
        check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        super().__init__(
            ComposedClient(SAMPerturbation(rho), [MomentumCorrection(1.0 - alpha)], grad_scale=alpha),
            PseudoGradientServer(ServerRule(server_lr)),
        )
