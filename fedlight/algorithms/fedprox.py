"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks").

Client objective ``ℓ(y) + (μ/2)‖y − x_r‖²``, i.e. ``d = g + μ(y − x_r)`` (inside the clip, unlike the
released FL-Simulator code whose ``−μx_r`` half is clipped and ``+μy`` half is not). Server: FedAvg.
``μ = 0`` is FedAvg exactly.
"""

from __future__ import annotations

import torch

from fedlight import params as P
from fedlight.errors import check
from fedlight.registry import register
from fedlight.rules import Algorithm, LocalUpdateRule, ServerRule


class ProxClient(LocalUpdateRule):
    """SGD on ``ℓ(y) + (μ/2)‖y − y_0‖²``."""

    def __init__(self, mu: float = 0.01) -> None:
        self.mu = mu

    def step(self, model, batch, ctx):
        loss = ctx.forward_backward(model, batch)  # g
        if self.mu:
            g, y, y0 = list(ctx.grads().values()), list(ctx.params.values()), list(ctx.broadcast.params.values())
            with torch.no_grad():
                torch._foreach_add_(g, torch._foreach_sub(y, y0), alpha=self.mu)  # d = g + μ(y − x_r)
        ctx.apply()
        return loss


@register("fedprox", paper="Li et al., MLSys 2020", backprops=1, comm=(1, 1))
class FedProx(Algorithm):
    """FedProx.

    Args:
        mu: μ, proximal coefficient (≥ 0; 0 is FedAvg).
        server_lr: η_g.
    """

    def __init__(self, mu: float = 0.01, server_lr: float = 1.0) -> None:
        check(mu >= 0, f"`algorithm.mu` must be >= 0, got {mu}")
        super().__init__(ProxClient(mu), ServerRule(server_lr))
