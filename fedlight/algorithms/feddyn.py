"""FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization").

State: per-client ``∇L_i`` (zeros), server ``h`` (zeros).
  client objective   ℓ(y) − ⟨∇L_i, y⟩ + (α/2)‖y − x_r‖²,  so  d = g − ∇L_i + α(y − x_r)
  after K steps      ∇L_i ← ∇L_i − α(y_{i,K} − x_r)
  server             h ← h − α·(1/N)·Σ_{i∈S}(y_{i,K} − x_r);   x ← mean_{i∈S} y_{i,K} − h/α
Both server means are plain means over S, as the paper writes them (``weighting = "uniform"``, whatever
``loop.weighting`` says): ``(1/N)·Σ_{i∈S}`` is ``(|S|/N)·Δ̄`` with the uniform ``Δ̄``. ``mean y_{i,K}`` comes
from the inner server (FedAvg with η_g = 1), so FedDyn's server wraps others (FedNSAM-D, FedLESAM-D).
"""

from __future__ import annotations

import torch

from fedlight.algorithms.compose import ComposedClient, Correction, ServerWrapper, state_params, values
from fedlight.algorithms.fedprox import ProxCorrection
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


class DynCorrection(Correction):
    """``d += −∇L_i + α(y − x_r)``; after K steps ``∇L_i ← ∇L_i − α·Δ_i``."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.prox = ProxCorrection(alpha)

    def start(self, model, ctx):
        ctx.scratch["grad_L"] = values(state_params(ctx, "grad_L"), ctx.params)

    def add(self, ctx, d):
        torch._foreach_sub_(d, ctx.scratch["grad_L"])  # d −= ∇L_i
        self.prox.add(ctx, d)  # d += α(y − x_r)

    def finish(self, ctx, result):
        ctx.state["grad_L"] = P.add(ctx.state["grad_L"], result.delta, -self.alpha)  # ∇L_i ← ∇L_i − α(y − x_r)


class DynServer(ServerWrapper):
    """``h ← h − α·(|S|/N)·Δ̄``; ``x ← inner(x) − h/α`` (``Δ̄`` the plain mean over S)."""

    state_keys = ("h",)
    weighting = "uniform"  # (1/N)·Σ_{i∈S} and mean_{i∈S}: the paper's server has no sample weights

    def __init__(self, inner, alpha: float) -> None:
        super().__init__(inner)
        self.alpha = alpha

    def setup(self, params):
        super().setup(params)
        self.h = P.zeros_like(params)

    def update(self, params, agg, info):
        self.h = P.add(self.h, agg.delta, -self.alpha * len(info.sampled) / info.num_clients)  # (1/N)·Σ_{i∈S}
        return P.add(super().update(params, agg, info), self.h, -1.0 / self.alpha)  # x ← mean y − h/α

    def diagnostics(self):
        return {**super().diagnostics(), "h_norm": float(P.norm(self.h))}


@register("feddyn", paper="Acar et al., ICLR 2021", backprops=1, comm=(1, 1), stateful_clients=True)
class FedDyn(Algorithm):
    """FedDyn.

    Args:
        alpha: α, the dynamic-regularization coefficient (> 0).
    """

    def __init__(self, alpha: float = 0.1) -> None:
        check(alpha > 0, f"`algorithm.alpha` must be > 0, got {alpha}")
        super().__init__(ComposedClient(corrections=[DynCorrection(alpha)]), DynServer(ServerRule(1.0), alpha))
