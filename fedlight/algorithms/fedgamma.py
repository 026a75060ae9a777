"""FedGAMMA (Dai et al. 2023, "FedGAMMA: Federated Learning With Global Sharpness-Aware Minimization",
IEEE TNNLS).

SAM local steps with SCAFFOLD's drift correction and SCAFFOLD's control-variate bookkeeping:
  g   = ∇ℓ(y);  e = ρ·g/(‖g‖ + 1e-12)                      SAM ascent (SAMPerturbation)
  g'  = ∇ℓ(y + e)                                          BN running stats frozen on this pass
  d   = g' + c − c_i                                       (ScaffoldCorrection, inside the clip)
  after K steps  c_i⁺ = c_i − c + (x_r − y_{i,K})/(K·η_r); upload Δ_i and Δc_i = c_i⁺ − c_i
  server         x ← x + η_g·Δ̄;  c ← c + (1/N)·Σ_{i∈S} Δc_i      (ScaffoldServer)
Two backprops per step; 2 vectors down (x_r, c), 2 up (Δ_i, Δc_i). ``ρ = 0`` is SCAFFOLD exactly.

ρ defaults to 0.05, inside the 0.01–0.1 range of the papers' tables; the FL-Simulator code behind the
FedWMSAM comparison tables runs FedGAMMA with its default ``--rho 0.1``, so recipes reproducing those tables
set ``rho: 0.1``. Some released code adds the SCAFFOLD term through a detached ``.item()``
(no gradient effect: that is FedSAM); here it is part of ``d``.
"""

from __future__ import annotations

from fedlight.algorithms.compose import ComposedClient
from fedlight.algorithms.fedsam import SAMPerturbation
from fedlight.algorithms.scaffold import ScaffoldCorrection, ScaffoldServer
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


@register("fedgamma", paper="Dai et al., IEEE TNNLS 2023", backprops=2, comm=(2, 2), stateful_clients=True)
class FedGAMMA(Algorithm):
    """FedGAMMA: SAM + SCAFFOLD.

    Args:
        rho: ρ, SAM radius (≥ 0; 0 is SCAFFOLD). The papers' tables use 0.01–0.1.
        server_lr: η_g.
    """

    def __init__(self, rho: float = 0.05, server_lr: float = 1.0) -> None:
        check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        local = ComposedClient(SAMPerturbation(rho), [ScaffoldCorrection()])  # d = g' + c − c_i
        super().__init__(local, ScaffoldServer(ServerRule(server_lr)))
