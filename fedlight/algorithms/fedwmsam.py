"""FedWMSAM (Li, Huang et al., NeurIPS 2025, "FedWMSAM: Fast and Flat Federated Learning via Weighted Momentum
and Sharpness-Aware Minimization", arXiv:2511.22080) — seed paper, Algorithm 1. One backprop per local step.

State: server global momentum ``M`` (a pseudo-gradient, zeros), SCAFFOLD ``c`` and per-client ``c_i`` (zeros,
kept by the client), the scalar weight ``α`` (init 0.1, server state).
  personalized momentum   u_i = M + (α/(1 − α))·(c − c_i)                                  (eq. 1)
  extrapolated point      x̃_b = x_r + b·u_i,  b = 0..K−1                                   (Alg. 1, line 14)
  perturbation            δ_b = x̃_b − y_b;   e_b = ρ·δ_b/‖δ_b‖   (0 at b = 0 or when δ_b = 0)  (Alg. 1, line 15)
  local direction         d = α·∇ℓ(y_b + e_b) + (1 − α)·u_i;  y_{b+1} = y_b − η_r·d    (eq. 2, lines 16–17)
  after K steps           c_i⁺ = c_i − c + (x_r − y_{i,K})/(K·η_r);  upload Δ_i, Δc_i       (eq. 5)
  server                  c ← c + (1/N)·Σ_{i∈S} Δc_i;   M ← −Δ̄/(K·η_r);   x ← x + η_g·Δ̄
  adaptive weight         α̂ = mean_{i∈S} cos(M, u_i);   α ← (1 − γ)·α + γ·clip(α̂, 0.1, 0.9)  (eqs. 3–4)
Since y_b = x_r − η·Σ_{j<b} d_j, δ_b = b·u_i + η·Σ_{j<b} d_j: an ascent along the global momentum and the
accumulated local directions. ``α̂`` uses ``M`` and ``u_i`` as this round broadcast them; a cosine with a zero
vector counts as 0 (round 0 gives α̂ = 0). The new ``α`` is used from the next round.

``c_i`` stays with the client: down ``x_r``, ``M``, ``c`` and the scalar ``α``; up ``Δ_i``, ``Δc_i`` and the
similarity scalar (``comm = (3, 2)``). ``perturbation="released"`` (δ_b = y_b − x̃_b, the released code's sign)
and ``similarity="update"`` (α̂ = mean_S (1 + cos(Δ_i, M))) reproduce the authors' code; the corrector update,
the released code and the reproduction notes are in ``docs/algorithms.md`` (FedWMSAM).

Logged per round: ``server/alpha`` (the next round's α), ``server/alpha_hat``, ``server/M_norm``,
``server/c_norm``, ``rule/control_gap_norm`` (mean_S ‖c − c_i‖ as broadcast), ``rule/similarity`` and
``rule/perturbation_norm``. Refuses ``16-mixed`` precision, like the rest of the SAM family.
"""

from __future__ import annotations

from typing import Literal

import torch

from fedlight.algorithms.compose import ComposedClient, Perturbation, ServerWrapper, released, state_params
from fedlight.algorithms.fedcm import MomentumCorrection, PseudoGradientServer
from fedlight.algorithms.scaffold import ScaffoldCorrection, ScaffoldServer
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check

ALPHA_MIN, ALPHA_MAX = 0.1, 0.9  # clip range of α̂ (eq. 4)



class WMSAMPerturbation(Perturbation):
    """Momentum-guided offset ``e_b = ρ·δ_b/‖δ_b‖`` with ``δ_b = (x_r + b·u_i) − y_b`` (no extra backprop).

    ``u_i`` is read from ``ctx.scratch["u"]`` (set by :class:`WMSAMClient`); ``b = ctx.step_index``.

    Args:
        rho: ρ, the perturbation radius.
        form: ``"paper"`` (Algorithm 1, line 15) or ``"released"`` (the released code's sign, ``−δ_b``).
    """

    # The norm is of a parameter difference, not of a gradient; FedWMSAM nevertheless refuses 16-mixed with the rest
    # of the SAM family, whose offsets follow the local steps (one precision policy for the family).
    needs_true_grad_norm = True

    uses_backprop = False

    def __init__(self, rho: float, form: str = "paper") -> None:
        self.rho = rho
        self.sign = -1.0 if released("perturbation", form) else 1.0

    def __call__(self, model, batch, ctx):
        b = ctx.step_index
        if b == 0 or not self.rho:
            return None, None  # δ_0 = x_r − y_0 = 0  ⇒  e_0 = 0
        x_tilde = P.add(ctx.broadcast.params, ctx.scratch["u"], float(b))  # x̃_b = x_r + b·u_i  (line 14)
        delta = P.sub(x_tilde, ctx.params)  # δ_b = x̃_b − y_b  (line 15)
        e = P.scale(P.unit(delta), self.sign * self.rho)  # e_b = ρ·δ_b/‖δ_b‖ (0 when δ_b = 0)
        ctx.metrics["perturbation_norm"] = P.norm(e)
        return e, None


class _ControlVariates(ScaffoldCorrection):
    """SCAFFOLD's ``c_i`` bookkeeping (``start``: ‖c − c_i‖ metric; ``finish``: option-II update and ``Δc_i``
    upload) without its drift term: FedWMSAM puts ``c − c_i`` into ``u_i`` instead."""

    def add(self, ctx, d):
        pass


class _PersonalizedMomentum(MomentumCorrection):
    """``d += (1 − α_r)·u_i`` with ``u_i`` and ``α_r`` from :meth:`WMSAMClient.start`."""

    def direction(self, ctx):
        return ctx.scratch["u"]

    def weight(self, ctx):
        return 1.0 - ctx.scratch["alpha"]


class WMSAMClient(ComposedClient):
    """``d = α_r·∇ℓ(y + e) + (1 − α_r)·u_i``; ``α_r`` comes with the broadcast, so it changes per round.

    Args:
        perturbation: the offset rule (``None``: ``e = 0``, the ``sam=False`` ablation).
        personalized: ``u_i = M + (α/(1 − α))(c − c_i)`` (True) or ``u_i = M`` (no control variates).
        similarity: the per-client value whose mean is α̂: ``"momentum"`` cos(M, u_i), ``"update"`` 1 + cos(Δ_i, M).
        adaptive: whether the value is uploaded (counted in communication) for the α update.
    """

    def __init__(self, perturbation: Perturbation | None, personalized: bool, similarity: str, adaptive: bool) -> None:
        corrections = [_ControlVariates()] if personalized else []
        super().__init__(perturbation, [*corrections, _PersonalizedMomentum(key="u")])
        self.personalized, self.similarity, self.adaptive = personalized, similarity, adaptive
        if adaptive:
            self.scalar_uploads = "the similarity whose mean over the clients sets α̂"

    def start(self, model, ctx):
        bc = ctx.broadcast
        alpha, M = bc.scalars["alpha"], bc.extras["M"]
        if self.personalized:
            gap = P.sub(bc.extras["c"], state_params(ctx, "c_i"))
            u = P.add(M, gap, alpha / (1.0 - alpha))  # u_i = M + (α/(1 − α))·(c − c_i)  (eq. 1)
        else:
            u = M  # u_i = M  (ablation)
        ctx.scratch["u"], ctx.scratch["alpha"] = u, alpha
        if self.similarity == "momentum":
            ctx.metrics["similarity"] = P.cosine(M, u)  # cos(M, u_i), 0 for a zero vector  (eq. 3)
        super().start(model, ctx)

    def step(self, model, batch, ctx):
        self.grad_scale = ctx.scratch["alpha"]  # α_r·∇ℓ(y + e)  (eq. 2); ComposedClient's scale is per round here
        return super().step(model, batch, ctx)

    def finish(self, model, ctx):
        result = super().finish(model, ctx)
        if self.similarity == "update":
            M = ctx.broadcast.extras["M"]
            nonzero = (P.norm(M) > 0) & (P.norm(result.delta) > 0)
            result.metrics["similarity"] = torch.where(nonzero, 1.0 + P.cosine(result.delta, M), 0.0)  # 1 + cos(Δ_i, M)
        if self.adaptive:
            result.upload_scalars += 1  # the similarity value
        return result


class AdaptiveWeightServer(ServerWrapper):
    """Keeps the scalar ``α``, broadcasts it, and updates it from the clients' mean similarity:
    ``α ← (1 − γ)·α + γ·clip(α̂, 0.1, 0.9)`` (eq. 4). With ``adaptive=False`` ``α`` stays fixed.

    Args:
        inner: the server that owns ``x`` (and ``M``, ``c``).
        alpha: α_0.
        gamma: γ, the update rate of α.
        adaptive: whether α is updated.
    """

    state_keys = ("alpha", "alpha_hat")

    def __init__(self, inner: ServerRule, alpha: float, gamma: float, adaptive: bool) -> None:
        super().__init__(inner)
        self.alpha, self.alpha_hat = float(alpha), 0.0
        self.gamma, self.adaptive = gamma, adaptive

    def broadcast(self, params, info, client_id):
        bc = super().broadcast(params, info, client_id)
        bc.scalars["alpha"] = self.alpha
        return bc

    def update(self, params, agg, info):
        self.alpha_hat = float(agg.metrics["similarity"])  # α̂ = mean_S cos(M, u_i)  (eq. 3)
        if self.adaptive:
            clipped = min(max(self.alpha_hat, ALPHA_MIN), ALPHA_MAX)
            self.alpha = (1.0 - self.gamma) * self.alpha + self.gamma * clipped  # (eq. 4)
        return super().update(params, agg, info)

    def diagnostics(self):
        return {**super().diagnostics(), "alpha": self.alpha, "alpha_hat": self.alpha_hat}


def fedwmsam_rules(alpha: float = 0.1, rho: float = 0.01, gamma: float = 0.01, personalized: bool = True,
                   sam: bool = True, adaptive: bool = True, similarity: str = "momentum",
                   perturbation: str = "paper", server_lr: float = 1.0) -> tuple[WMSAMClient, ServerRule]:
    """The (client, server) pair; exposed so variants can wrap or replace one half."""
    pert = WMSAMPerturbation(rho, perturbation) if sam else None
    client = WMSAMClient(pert, personalized, similarity, adaptive)
    server: ServerRule = ServerRule(server_lr)
    if personalized:
        server = ScaffoldServer(server)  # c ← c + (1/N)·Σ Δc_i   (eq. 5)
    server = PseudoGradientServer(server, key="M")  # M ← −Δ̄/(K·η_r)
    return client, AdaptiveWeightServer(server, alpha, gamma, adaptive)


@register("fedwmsam", paper="Li, Huang et al., NeurIPS 2025 (arXiv:2511.22080)", backprops=1, comm=(3, 2),
          stateful_clients=True)
class FedWMSAM(Algorithm):
    """FedWMSAM: personalized global momentum, a momentum-guided one-backprop SAM offset, and an adaptive α.

    Download ``x_r``, ``M``, ``c`` and the scalar ``α`` (3 vectors); upload ``Δ_i``, ``Δc_i`` and the similarity
    scalar (2 vectors). ``c_i`` stays with the client. See the module docstring for the equations.

    Args:
        alpha: α_0, the initial weight of the local (SAM) gradient against the momentum (0 < α < 1).
        rho: ρ, the perturbation radius (≥ 0; 0.01 in the paper's experiments, §5.1; the released runs used 0.1).
        gamma: γ, the update rate of α (0 ≤ γ ≤ 1).
        personalized: use ``u_i = M + (α/(1 − α))(c − c_i)``; False: ``u_i = M`` and no control variates.
        sam: use the momentum-guided perturbation; False: ``e = 0``.
        adaptive: update α each round; False: α stays α_0.
        similarity: "momentum": α̂ = mean cos(M, u_i) (paper); "update": α̂ = mean(1 + cos(Δ_i, M)) (released code).
        perturbation: "paper": δ_b = (x_r + b·u_i) − y_b (Algorithm 1, line 15); "released": δ_b = y_b − (x_r + b·u_i)
            (the released code's sign, as one vector).
        server_lr: η_g.
    """

    def __init__(self, alpha: float = 0.1, rho: float = 0.01, gamma: float = 0.01, personalized: bool = True,
                 sam: bool = True, adaptive: bool = True, similarity: Literal["momentum", "update"] = "momentum",
                 perturbation: Literal["paper", "released"] = "paper",
                 server_lr: float = 1.0) -> None:
        check(0 < alpha < 1, f"`algorithm.alpha` must be in (0, 1), got {alpha}")
        check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")
        check(0 <= gamma <= 1, f"`algorithm.gamma` must be in [0, 1], got {gamma}")
        check(similarity in ("momentum", "update"),
              f"`algorithm.similarity` must be 'momentum' or 'update', got {similarity!r}")
        released("perturbation", perturbation)  # checked here too: ``sam=False`` builds no perturbation
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        super().__init__(*fedwmsam_rules(alpha, rho, gamma, personalized, sam, adaptive, similarity, perturbation,
                                         server_lr))
