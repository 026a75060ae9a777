"""FedSMOO (Sun et al. 2023, "Dynamic Regularized Sharpness Aware Minimization in Federated Learning:
Approaching Global Consistency and Smooth Landscape", ICML).

FedDyn's dynamic regularizer plus a SAM perturbation that is itself steered by a primal-dual pair, so the
clients' perturbations agree with a global one.
State: per-client ``∇L_i`` (FedDyn dual) and ``μ_i`` (perturbation dual), server ``h`` and ``s``; all zeros.
Broadcast ``x_r`` and ``s``.  Each local step (two backprops):
  g   = ∇ℓ(y)                                       BN running stats updated here, once per step
  ĝ   = g − μ_i − s                                 dual-corrected ascent direction
  e   = ρ·ĝ/(‖ĝ‖ + 1e-12)                           (zero when ĝ = 0)
  μ_i ← μ_i + e − s                                 dynamic dual update, persists across steps and rounds
  g'  = ∇ℓ(y + e)                                   BN running stats frozen
  d   = g' − ∇L_i + λ(y − x_r)                      (DynCorrection with α = λ, inside the clip)
After K steps  ∇L_i ← ∇L_i − λ(y_{i,K} − x_r); upload Δ_i and μ_i.
Server         h ← h − λ·(1/N)·Σ_{i∈S}(y_{i,K} − x_r);  x ← mean_S y_{i,K} − h/λ      (DynServer)
               s ← ρ·mean_S(μ_i)/‖mean_S(μ_i)‖  (zero when the mean is zero)         (SmooServer)
Communication: 2 vectors down (x_r, s), 2 up (Δ_i, μ_i). ``ρ = 0`` is FedDyn with α = λ exactly
(then e = 0, μ_i stays 0 and s stays 0).

Released-code differences: ``docs/algorithms.md`` (Baselines).
"""

from __future__ import annotations

from fedlight.algorithms.compose import ComposedClient, Correction, ServerWrapper, state_params
from fedlight.algorithms.feddyn import DynCorrection, DynServer
from fedlight.algorithms.fedsam import SAMPerturbation
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


class SMOOPerturbation(SAMPerturbation):
    """SAM ascent along ``ĝ = g − μ_i − s``, updating the client's dynamic dual ``μ_i`` in place."""

    def start(self, model, ctx):
        state_params(ctx, "mu")  # μ_i (zeros for a client never seen)

    def direction(self, g, ctx):
        mu, s = ctx.state["mu"], ctx.broadcast.extras["s"]
        g_hat = P.lincomb([(1.0, g), (-1.0, mu), (-1.0, s)])  # ĝ = g − μ_i − s
        e = P.scale(P.unit(g_hat, eps=1e-12), self.rho)  # e = ρ·ĝ/‖ĝ‖
        P.add_(mu, P.sub(e, s))  # μ_i ← μ_i + e − s
        return e


class DualUpload(Correction):
    """No drift term: after K steps the client uploads its dynamic dual ``μ_i`` (averaged by the loop)."""

    def finish(self, ctx, result):
        result.extras["mu"] = ctx.state["mu"]
        ctx.metrics["mu_norm"] = P.norm(ctx.state["mu"])  # ‖μ_i‖


class SmooServer(ServerWrapper):
    """Adds the global perturbation dual ``s``: broadcast it; after the inner update ``s ← ρ·unit(mean_S μ_i)``."""

    state_keys = ("s",)

    def __init__(self, inner: ServerRule, rho: float) -> None:
        super().__init__(inner)
        self.rho = rho
        self._mu_mean_norm = 0.0

    def setup(self, params):
        super().setup(params)
        self.s = P.zeros_like(params)

    def broadcast(self, params, info, client_id):
        bc = super().broadcast(params, info, client_id)
        bc.extras["s"] = self.s
        return bc

    def update(self, params, agg, info):
        x = super().update(params, agg, info)
        mu_bar = agg.extras["mu"]  # mean_S(μ_i)
        self._mu_mean_norm = float(P.norm(mu_bar))
        self.s = P.scale(P.unit(mu_bar), self.rho)  # s ← ρ·mean_S(μ_i)/‖mean_S(μ_i)‖
        return x

    def diagnostics(self):
        return {**super().diagnostics(), "s_norm": float(P.norm(self.s)), "mu_mean_norm": self._mu_mean_norm}


@register("fedsmoo", paper="Sun et al., ICML 2023", backprops=2, comm=(2, 2), stateful_clients=True)
class FedSMOO(Algorithm):
    """FedSMOO: dynamic-regularized SAM with a global perturbation dual.

    Args:
        rho: ρ, SAM radius and norm of the global dual s (≥ 0; 0 is FedDyn).
        lam: λ, the FedDyn coefficient (plays FedDyn's α; > 0).
    """

    def __init__(self, rho: float = 0.1, lam: float = 0.1) -> None:
        check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")
        check(lam > 0, f"`algorithm.lam` must be > 0, got {lam}")
        local = ComposedClient(SMOOPerturbation(rho), [DynCorrection(lam), DualUpload()])  # d = g' − ∇L_i + λ(y − x_r)
        super().__init__(local, SmooServer(DynServer(ServerRule(1.0), lam), rho))
