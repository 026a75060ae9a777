"""FedASAM (Caldarola et al. 2022, "Improving Generalization in Federated Learning by Seeking Flat Minima").

FedSAM with Adaptive SAM's perturbation (Kwon et al. 2021): with ``T = |y| + η_a`` (elementwise),
  e = ρ·T²⊙g / ‖T⊙g‖
Two backprops; server FedAvg. Defaults ρ = 0.5, η_a = 0.01 (ASAM's recommended values).
"""

from __future__ import annotations

import torch

from fedlight.algorithms.compose import ComposedClient
from fedlight.algorithms.fedsam import SAMPerturbation
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


class ASAMPerturbation(SAMPerturbation):
    """``e = ρ·T²g/‖Tg‖`` with ``T = |y| + η_a``."""

    def __init__(self, rho: float, eta: float) -> None:
        super().__init__(rho)
        self.eta = eta

    def direction(self, g, ctx):
        with torch.no_grad():
            T = {k: y.detach().abs().add_(self.eta) for k, y in ctx.params.items()}
            Tg = {k: T[k] * g[k] for k in g}
            n = P.norm(Tg)
            coef = torch.where(n > 0, self.rho / n.clamp_min(1e-300), torch.zeros_like(n))
            return P.scale({k: T[k] * Tg[k] for k in g}, coef.to(next(iter(g.values())).dtype))  # ρ·T²g/‖Tg‖


@register("fedasam", paper="Caldarola et al., ECCV 2022", backprops=2, comm=(1, 1))
class FedASAM(Algorithm):
    """FedASAM.

    Args:
        rho: ρ, ASAM radius (≥ 0).
        eta: η_a, the offset in ``T = |y| + η_a`` (≥ 0).
        server_lr: η_g.
    """

    def __init__(self, rho: float = 0.5, eta: float = 0.01, server_lr: float = 1.0) -> None:
        check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")
        check(eta >= 0, f"`algorithm.eta` must be >= 0, got {eta}")
        super().__init__(ComposedClient(ASAMPerturbation(rho, eta)), ServerRule(server_lr))
