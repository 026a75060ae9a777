"""FedAvgM (Hsu et al. 2019, "Measuring the Effects of Non-Identical Data Distribution...").

Server momentum on the averaged update: ``m ← β·m + Δ̄``; ``x ← x + η_g·m``. Clients are FedAvg.
"""

from __future__ import annotations

from fedlight.core import params as P
from fedlight.core.params import Params
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ClientResult, LocalUpdateRule, RoundInfo, ServerRule
from fedlight.errors import check


class MomentumServer(ServerRule):
    """``m ← β·m + Δ̄; x ← x + η_g·m`` (m starts at 0)."""

    state_keys = ("m",)

    def __init__(self, beta: float = 0.9, lr: float = 1.0) -> None:
        super().__init__(lr)
        self.beta = beta

    def setup(self, params: Params) -> None:
        self.m = P.zeros_like(params)

    def update(self, params: Params, agg: ClientResult, info: RoundInfo) -> Params:
        self.m = P.add(P.scale(self.m, self.beta), agg.delta)  # m ← β·m + Δ̄
        return P.add(params, self.m, self.lr)  # x ← x + η_g·m

    def diagnostics(self) -> dict[str, float]:
        return {"momentum_norm": float(P.norm(self.m))}


@register("fedavgm", paper="Hsu et al., arXiv:1909.06335 (2019)", backprops=1, comm=(1, 1))
class FedAvgM(Algorithm):
    """FedAvg with server momentum.

    Args:
        beta: β, server momentum (0 ≤ β < 1; 0 is FedAvg).
        server_lr: η_g.
    """

    def __init__(self, beta: float = 0.9, server_lr: float = 1.0) -> None:
        check(0 <= beta < 1, f"`algorithm.beta` must be in [0, 1), got {beta}")
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        super().__init__(LocalUpdateRule(), MomentumServer(beta, server_lr))
