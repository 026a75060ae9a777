"""FedSpeed (Sun et al. 2023, "FedSpeed: Larger Local Interval, Less Communication Round, and Higher
Generalization Accuracy", ICLR).

A prox-correction (FedDyn-style dynamic regularizer) on top of SAM local steps: FedSMOO without the
perturbation duals ``μ_i`` and ``s``.
State: per-client ``∇L_i``, server ``h`` (zeros). Each local step (two backprops):
  g   = ∇ℓ(y);  e = ρ·g/(‖g‖ + 1e-12)               SAM ascent (SAMPerturbation)
  g'  = ∇ℓ(y + e)                                   BN running stats frozen
  d   = g' − ∇L_i + λ(y − x_r)                      prox-correction (DynCorrection with α = λ)
After K steps  ∇L_i ← ∇L_i − λ(y_{i,K} − x_r).
Server         h ← h − λ·(1/N)·Σ_{i∈S}(y_{i,K} − x_r);  x ← mean_S y_{i,K} − h/λ      (DynServer)
1 vector down, 1 up. ``ρ = 0`` is FedDyn with α = λ exactly.

Defaults ρ = 0.1, λ = 0.1 (the released code's). How the paper and the released code differ: ``docs/algorithms.md``
(Baselines).
"""

from __future__ import annotations

from fedlight.algorithms.compose import ComposedClient
from fedlight.algorithms.feddyn import DynCorrection, DynServer
from fedlight.algorithms.fedsam import SAMPerturbation
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


@register("fedspeed", paper="Sun et al., ICLR 2023", backprops=2, comm=(1, 1), stateful_clients=True)
class FedSpeed(Algorithm):
    """FedSpeed: SAM + FedDyn-style prox-correction.

    Args:
        rho: ρ, SAM radius (≥ 0; 0 is FedDyn).
        lam: λ, the prox-correction coefficient (plays FedDyn's α; > 0).
    """

    def __init__(self, rho: float = 0.1, lam: float = 0.1) -> None:
        check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")
        check(lam > 0, f"`algorithm.lam` must be > 0, got {lam}")
        local = ComposedClient(SAMPerturbation(rho), [DynCorrection(lam)])  # d = g' − ∇L_i + λ(y − x_r)
        super().__init__(local, DynServer(ServerRule(1.0), lam))
