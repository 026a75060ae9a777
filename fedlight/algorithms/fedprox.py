"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks").

Client objective ``ℓ(y) + (μ/2)‖y − x_r‖²``, i.e. ``d = g + μ(y − x_r)``, inside the clip (the released
FL-Simulator code clips the ``−μx_r`` half but not the ``+μy`` half; fedlight follows the paper).
Server: FedAvg. ``μ = 0`` is FedAvg exactly.
"""

from __future__ import annotations

import torch

from fedlight.algorithms.compose import ComposedClient, Correction, values
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


class ProxCorrection(Correction):
    """``d += μ(y − y_0)``: the gradient of ``(μ/2)‖y − y_0‖²`` around the round's start point ``y_0``.

    Also FedDyn's ``α(y − x_r)`` and FedACG's ``β(y − y_0)``.
    """

    def __init__(self, mu: float) -> None:
        self.mu = mu

    def add(self, ctx, d):
        if self.mu:
            y, y0 = list(ctx.params.values()), values(ctx.broadcast.params, ctx.params)
            torch._foreach_add_(d, torch._foreach_sub(y, y0), alpha=self.mu)  # d += μ(y − x_r)


@register("fedprox", paper="Li et al., MLSys 2020", backprops=1, comm=(1, 1))
class FedProx(Algorithm):
    """FedProx.

    Args:
        mu: μ, proximal coefficient (≥ 0; 0 is FedAvg).
        server_lr: η_g.
    """

    def __init__(self, mu: float = 0.01, server_lr: float = 1.0) -> None:
        check(mu >= 0, f"`algorithm.mu` must be >= 0, got {mu}")
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        super().__init__(ComposedClient(corrections=[ProxCorrection(mu)]), ServerRule(server_lr))
