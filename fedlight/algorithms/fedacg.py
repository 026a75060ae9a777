"""FedACG (Kim et al. 2024, "Communication-Efficient Federated Learning with Accelerated Client Gradient", CVPR).

State: server momentum ``m`` (zeros). The server sends ONE vector, the look-ahead point, and clients start there:
  broadcast          y_0 = x_r + λ·m                                       (Alg. 1 L4)
  client objective   ℓ(y) + (β/2)‖y − y_0‖²,  i.e.  d = g + β(y − y_0)     (Alg. 1 L8, eq. 5)
  upload             Δ_i = y_{i,K} − y_0
  server             m ← λ·m + Δ̄;   x ← x + m                              (Alg. 1 L13-14)
so ``x_{r+1} = y_0 + Δ̄ = mean_i y_{i,K}``. The server half is FedAvgM's :class:`MomentumServer` (η_g = 1) with a
look-ahead broadcast; the client half is FedProx's :class:`ProxCorrection` around ``broadcast.params = y_0``.
The proximal term is a real gradient term inside the clip (the released J code computes it with ``.item()``
so it has no effect there). ``λ = 0, β = 0`` is FedAvg exactly. Momentum applies to parameters only; BatchNorm
statistics are averaged as usual.
"""

from __future__ import annotations

from fedlight.algorithms.compose import ComposedClient
from fedlight.algorithms.fedavgm import MomentumServer
from fedlight.algorithms.fedprox import ProxCorrection
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, Broadcast
from fedlight.errors import check


class LookaheadServer(MomentumServer):
    """:class:`MomentumServer` (``m ← λ·m + Δ̄; x ← x + η_g·m``; its ``beta`` is FedACG's λ) that broadcasts the
    look-ahead point ``y_0 = x_r + λ·m`` instead of ``x_r``."""

    def broadcast(self, params, info, client_id):
        if not self.beta:
            return Broadcast(params)
        return Broadcast(P.add(params, self.m, self.beta))  # y_0 = x_r + λ·m


@register("fedacg", paper="Kim et al., CVPR 2024", backprops=1, comm=(1, 1))
class FedACG(Algorithm):
    """FedACG: server momentum with a look-ahead broadcast and a proximal client objective.

    Download ``y_0 = x_r + λm`` (1 vector), upload ``Δ_i = y_{i,K} − y_0`` (1).

    Args:
        lam: λ, server momentum and look-ahead coefficient (0 ≤ λ < 1).
        beta: β, the proximal coefficient around the look-ahead point (≥ 0).
    """

    def __init__(self, lam: float = 0.85, beta: float = 0.01) -> None:
        check(0 <= lam < 1, f"`algorithm.lam` must be in [0, 1), got {lam}")
        check(beta >= 0, f"`algorithm.beta` must be >= 0, got {beta}")
        super().__init__(ComposedClient(corrections=[ProxCorrection(beta)]), LookaheadServer(beta=lam, lr=1.0))
