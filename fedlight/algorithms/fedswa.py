"""FedSWA and FedMoSWA (Liu et al., ICML 2025, "Improving Generalization in Federated Learning with Highly
Heterogeneous Data via Momentum-Based Stochastic Controlled Weight Averaging").

Both clients lower the local learning rate linearly inside the round (a cyclic, SWA-style schedule):
  η_k = η_l·(1 − k/K) + (k/K)·ρ·η_l,   k = 0..K−1   (the first step uses η_l; η_l = the round's lr η_r)
computed as ``η_l·(1 − (1 − ρ)·k/K)`` (the same number, and exactly ``η_l`` when ρ = 1).
:class:`InRoundLinearLR` wraps any client rule with that schedule.

FedSWA
  client             K plain SGD steps with d = g at lr η_k
  server             v = mean_S y_{i,K};  x ← x + α·(v − x)   (= x + α·Δ̄: FedAvg's server with η_g = α)
FedMoSWA. State: server m (zeros), per-client c_i (zeros), kept by client id.
  broadcast          x_r and m
  client step        d = g − c_i + m   at lr η_k
  after K steps      c_i⁺ = c_i − m + (x_r − y_{i,K}) / Σ_k η_k
  upload             Δ_i and Δc_i = c_i⁺ − m;  store c_i ← c_i⁺
  server             m ← m + γ·mean_S(Δc_i) = (1 − γ)·m + γ·mean_S(c_i⁺);  x ← x + α·(v − x)
Defaults ρ = 0.01, α = 1, γ = 0.5. ``FedSWA ρ = 1, α = 1`` is FedAvg exactly.

Sign check of FedMoSWA (ALGORITHMS.md is right). ``(x_r − y_{i,K})/Σ_k η_k`` is the lr-weighted mean of the
directions used, ≈ ḡ_i − c_i + m, so ``c_i⁺ ≈ c_i − m + ḡ_i − c_i + m = ḡ_i``: ``c_i`` estimates client i's
own gradient, exactly like SCAFFOLD's c_i. The server makes ``m`` an exponential average of the ``c_i⁺``,
i.e. an estimate of the global gradient, playing SCAFFOLD's ``c``. Then ``d = g − c_i + m ≈ g − ∇f_i + ∇f``:
local drift is replaced by the global direction, and when all clients agree (c_i = m) the correction
vanishes. ``g − c_i + m`` is SCAFFOLD's ``g + c − c_i`` with ``c → m`` (same sign, terms reordered); the
control-variate update is SCAFFOLD's option II with ``c → m`` and ``K·η → Σ_k η_k``. Only the upload
(``c_i⁺ − m`` instead of ``c_i⁺ − c_i``) and the server (EMA over the sampled clients instead of
``c + (1/N)ΣΔc_i``) differ, so the client reuses :class:`~fedlight.algorithms.scaffold.ScaffoldCorrection`
(``m`` is broadcast under SCAFFOLD's key ``"c"``) and only overrides the upload. ``mean_S`` is the loop's
weighted mean, like Δ̄ (uniform for equal-size clients or ``weighting: uniform``).

Released code (``junkangLiu0/FedSWA``, ``main_FedSWA.py``) differs; recipes follow the paper, and these
are not options:
  * FedSWA (``update_FedSWA``): the lr starts at **2**·η_r and falls to 0 (ρ = 0 hard-coded, ``--rho``
    ignored), with the README's ``--lr 0.2`` on top (peak 0.4); the server α is ``--lg`` = 1. The closest
    fedlight run is ``fedswa`` with ``rho=0`` and the loop lr doubled.
  * FedMoSWA (``--alg MoFedSWA``: ``update_scafplus`` + ``apply_weights_SCAF``): **no cyclic lr** (constant
    η_r, i.e. ``rho=1``), the correction added after the clip, and ``m ← 0.6·m + 0.4·mean(c_i⁺)`` with
    γ = 0.4 hard-coded (the README's ``--gamma 0.5`` is ignored) except round 0, which sets ``m = mean c_i⁺``;
    c_i is kept per worker slot, not per client. ``fedmoswa`` with ``rho=1, gamma=0.4`` is the closest run.
"""

from __future__ import annotations

from fedlight import params as P
from fedlight.algorithms.compose import ComposedClient, ServerWrapper
from fedlight.algorithms.scaffold import ScaffoldCorrection
from fedlight.errors import check
from fedlight.registry import register
from fedlight.rules import Algorithm, LocalUpdateRule, ServerRule


def in_round_lr(lr: float, k: int, K: int, rho: float) -> float:
    """``η_k = η_l·(1 − k/K) + (k/K)·ρ·η_l``, written ``η_l·(1 − (1 − ρ)·k/K)`` (exact ``η_l`` at ρ = 1)."""
    return lr * (1.0 - (1.0 - rho) * k / K)


class InRoundLinearLR(LocalUpdateRule):
    """Runs ``inner`` with the local lr falling linearly from ``η_l`` towards ``ρ·η_l`` inside the round.

    Before local step ``k`` the optimizer's lr is set to ``η_k`` (:func:`in_round_lr`); ``ctx.lr_sum`` then
    accumulates ``Σ_k η_k`` for rules that divide by it.

    Args:
        inner: the client rule whose steps are rescheduled.
        rho: ρ, the end-of-round lr factor.
    """

    def __init__(self, inner: LocalUpdateRule, rho: float) -> None:
        self.inner, self.rho = inner, rho
        self.needs_true_grad_norm = inner.needs_true_grad_norm

    def make_optimizer(self, params, lr, default):
        return self.inner.make_optimizer(params, lr, default)

    def start(self, model, ctx):
        self.inner.start(model, ctx)

    def step(self, model, batch, ctx):
        ctx.set_lr(in_round_lr(ctx.lr, ctx.step_index, ctx.num_steps, self.rho))  # η_k
        return self.inner.step(model, batch, ctx)

    def finish(self, model, ctx):
        return self.inner.finish(model, ctx)


class MoSWACorrection(ScaffoldCorrection):
    """``d += m − c_i``; ``c_i⁺ = c_i − m + (x_r − y_{i,K})/Σ_k η_k``; upload ``Δc_i = c_i⁺ − m``.

    ``m`` arrives under SCAFFOLD's key ``"c"``; only the upload differs from SCAFFOLD.
    """

    def finish(self, ctx, result):
        super().finish(ctx, result)  # c_i⁺ = c_i − m + (x_r − y_{i,K})/Σ η_k;  c_i ← c_i⁺
        result.extras["delta_c"] = P.sub(ctx.state["c_i"], ctx.broadcast.extras["c"])  # Δc_i = c_i⁺ − m


class MoSWAServer(ServerWrapper):
    """Adds the momentum control variate ``m``: broadcast it; after the inner update ``m ← m + γ·mean_S(Δc_i)``.

    Args:
        inner: the server rule that moves ``x`` (FedSWA's ``x ← x + α(v − x)``).
        gamma: γ.
    """

    state_keys = ("m",)

    def __init__(self, inner: ServerRule, gamma: float) -> None:
        super().__init__(inner)
        self.gamma = gamma

    def setup(self, params):
        super().setup(params)
        self.m = P.zeros_like(params)

    def broadcast(self, params, info, client_id):
        bc = super().broadcast(params, info, client_id)
        bc.extras["c"] = self.m  # m, in the role (and under the key) of SCAFFOLD's c
        return bc

    def update(self, params, agg, info):
        x = super().update(params, agg, info)  # x ← x + α(v − x)
        self.m = P.add(self.m, agg.extras["delta_c"], self.gamma)  # m ← m + γ·mean_S(Δc_i)
        return x

    def diagnostics(self):
        return {**super().diagnostics(), "momentum_norm": float(P.norm(self.m))}


def _check_swa(rho: float, alpha: float) -> None:
    check(0 <= rho <= 1, f"`algorithm.rho` must be in [0, 1], got {rho}")
    check(0 < alpha <= 1, f"`algorithm.alpha` must be in (0, 1], got {alpha}")


@register("fedswa", paper="Liu et al., ICML 2025", backprops=1, comm=(1, 1))
class FedSWA(Algorithm):
    """FedSWA: SGD with a linearly falling in-round lr; server ``x ← x + α(mean y_{i,K} − x)``.

    Args:
        rho: ρ, the lr at the end of the round as a fraction of η_l (0 ≤ ρ ≤ 1; ``rho=1, alpha=1`` is FedAvg).
        alpha: α, the server's averaging weight (0 < α ≤ 1).
    """

    def __init__(self, rho: float = 0.01, alpha: float = 1.0) -> None:
        _check_swa(rho, alpha)
        super().__init__(InRoundLinearLR(LocalUpdateRule(), rho), ServerRule(lr=alpha))  # x + α·Δ̄ = x + α(v − x)


@register("fedmoswa", paper="Liu et al., ICML 2025", backprops=1, comm=(2, 2), stateful_clients=True)
class FedMoSWA(Algorithm):
    """FedMoSWA: FedSWA with momentum-based stochastic control variates (``d = g − c_i + m``).

    Args:
        rho: ρ, the lr at the end of the round as a fraction of η_l (0 ≤ ρ ≤ 1).
        alpha: α, the server's averaging weight (0 < α ≤ 1).
        gamma: γ, the server momentum step ``m ← m + γ·mean(c_i⁺ − m)`` (0 ≤ γ ≤ 1; the released code used 0.4).
    """

    def __init__(self, rho: float = 0.01, alpha: float = 1.0, gamma: float = 0.5) -> None:
        _check_swa(rho, alpha)
        check(0 <= gamma <= 1, f"`algorithm.gamma` must be in [0, 1], got {gamma}")
        super().__init__(InRoundLinearLR(ComposedClient(corrections=[MoSWACorrection()]), rho),
                         MoSWAServer(ServerRule(lr=alpha), gamma))
