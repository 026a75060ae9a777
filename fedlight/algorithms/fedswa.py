"""FedSWA and FedMoSWA (Liu et al., ICML 2025, "Improving Generalization in Federated Learning with Highly
Heterogeneous Data via Momentum-Based Stochastic Controlled Weight Averaging"), Algorithm 1.

Both clients lower the local learning rate linearly inside the round (line 8):
  η_k = η_l·(1 − k/K) + (k/K)·ρ·η_l,   k = 0..K−1   (the first step uses η_l; η_l = the round's lr η_r)
computed as ``η_l·(1 − (1 − ρ)·k/K)``. K steps, not the K + 1 that line 6's ``k = 0, …, K`` would give: lines
12–14 upload ``θ_{i,K}``, the model after K steps. :class:`InRoundLinearLR` wraps any client rule with it.

FedSWA
  client             K SGD steps with d = g at lr η_k                                        (line 9)
  server             v = (1/s)·Σ_{i∈S} y_{i,K};  x ← x + α·(v − x)                            (line 17)
FedMoSWA. State: server m (zeros), per-client c_i (zeros), kept by client id.
  broadcast          x_r and m                                                                (line 4)
  client step        d = g − c_i + m   at lr η_k                                              (line 10)
  after K steps      c_i⁺ = c_i − m + (x_r − y_{i,K}) / Σ_k η_k                              (line 13, option ii)
  upload             y_{i,K} (as Δ_i) and Δc_i = c_i⁺ − m;  store c_i ← c_i⁺                  (line 14)
  server             m ← m + γ·(1/s)·Σ_{i∈S} Δc_i;   x ← x + α·(v − x)                         (lines 16–17)
Every server mean is the plain mean over the s sampled clients, as the box writes it (``weighting = "uniform"``).
Defaults: α = 1 (``x = v``); the paper gives no value for ρ or γ, so the defaults are the released code's,
ρ = 0 and γ = 0.4. ``FedSWA ρ = 1, α = 1`` is FedAvg exactly. The released code and the sign check of the
control variates are in ``docs/algorithms.md`` (FedSWA / FedMoSWA).

FedMoSWA "as released" settings (each ``paper`` by default, ``released`` for the authors' code):
  first_round      round 0 uses γ = 1, so m₁ = mean_S c_i⁺ (the released server's first round)
  control_divisor  c_i⁺ divides by K·(η_l + ρ·η_l)/2 instead of Σ_k η_k = η_l·(K − (1 − ρ)(K − 1)/2)
                   (the unreachable released ``update_FedMoSWA``; equal at ρ = 1, K/(K + 1) of it at ρ = 0)
  clip_order       clip g alone, then add m − c_i (the released code); ``paper`` clips d (ALGORITHMS.md §0)
The runnable released "MoFedSWA" is ``rho=1, first_round="released", clip_order="released"`` (γ = 0.4).
"""

from __future__ import annotations

from typing import Literal

from fedlight.algorithms.compose import ComposedClient, ServerWrapper, released
from fedlight.algorithms.scaffold import ScaffoldCorrection
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, LocalUpdateRule, ServerRule
from fedlight.core.schedule import InRoundLR
from fedlight.errors import check


def in_round_lr(lr: float, k: int, K: int, rho: float) -> float:
    """``η_k = η_l·(1 − k/K) + (k/K)·ρ·η_l``, written ``η_l·(1 − (1 − ρ)·k/K)`` (exact ``η_l`` at ρ = 1)."""
    return lr * (1.0 - (1.0 - rho) * k / K)


class InRoundLinearLR(InRoundLR):
    """Runs ``inner`` with the local lr falling linearly from ``η_l`` towards ``ρ·η_l`` inside the round
    (:func:`in_round_lr`).

    Args:
        inner: the client rule whose steps are rescheduled.
        rho: ρ, the end-of-round lr factor.
    """

    def __init__(self, inner: LocalUpdateRule, rho: float) -> None:
        super().__init__(inner, lambda lr, k, K: in_round_lr(lr, k, K, rho))
        self.rho = rho


class MoSWACorrection(ScaffoldCorrection):
    """``d += m − c_i``; ``c_i⁺ = c_i − m + (x_r − y_{i,K})/Σ_k η_k``; upload ``Δc_i = c_i⁺ − m``.

    ``m`` arrives under SCAFFOLD's key ``"c"``; only the upload differs from SCAFFOLD.

    Args:
        mean_lr_divisor: divide by ``K·η_l·(1 + ρ)/2`` instead of ``Σ_k η_k`` (``control_divisor="released"``).
        rho: ρ of the in-round schedule (used by ``mean_lr_divisor`` only).
    """

    def __init__(self, mean_lr_divisor: bool = False, rho: float = 0.0) -> None:
        super().__init__()
        self.mean_lr_divisor, self.rho = mean_lr_divisor, rho

    def lr_sum(self, ctx):
        if self.mean_lr_divisor:
            return ctx.num_steps * ctx.lr * (1.0 + self.rho) / 2  # K·(η_l + ρη_l)/2
        return ctx.lr_sum  # Σ_k η_k

    def finish(self, ctx, result):
        super().finish(ctx, result)  # c_i⁺ = c_i − m + (x_r − y_{i,K})/Σ η_k;  c_i ← c_i⁺
        result.extras["delta_c"] = P.sub(ctx.state["c_i"], ctx.broadcast.extras["c"])  # Δc_i = c_i⁺ − m


class SWAServer(ServerRule):
    """``x ← x + α·(v − x)`` with ``v`` the plain mean of ``y_{i,K}`` over S (FedAvg's server, η_g = α)."""

    weighting = "uniform"  # line 17: v = (1/s)·Σ θ_{i,K}


class MoSWAServer(ServerWrapper):
    """Adds the momentum control variate ``m``: broadcast it; after the inner update ``m ← m + γ·mean_S(Δc_i)``.

    Args:
        inner: the server rule that moves ``x`` (FedSWA's ``x ← x + α(v − x)``).
        gamma: γ.
        first_gamma: γ of round 0 (None: ``gamma``; the released server: 1, ``m₁ = mean_S c_i⁺``).
    """

    state_keys = ("m",)

    def __init__(self, inner: ServerRule, gamma: float, first_gamma: float | None = None) -> None:
        super().__init__(inner)
        self.gamma = gamma
        self.first_gamma = gamma if first_gamma is None else first_gamma

    def setup(self, params):
        super().setup(params)
        self.m = P.zeros_like(params)

    def broadcast(self, params, info, client_id):
        bc = super().broadcast(params, info, client_id)
        bc.extras["c"] = self.m  # m, in the role (and under the key) of SCAFFOLD's c
        return bc

    def update(self, params, agg, info):
        x = super().update(params, agg, info)  # x ← x + α(v − x)
        gamma = self.first_gamma if info.round == 0 else self.gamma
        self.m = P.add(self.m, agg.extras["delta_c"], gamma)  # m ← m + γ·mean_S(Δc_i)
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
        rho: ρ, the lr at the end of the round as a fraction of η_l (0 ≤ ρ ≤ 1; not in the paper, 0 as in the
            released code; ``rho=1, alpha=1`` is FedAvg).
        alpha: α, the server's averaging weight (0 < α ≤ 1).
    """

    def __init__(self, rho: float = 0.0, alpha: float = 1.0) -> None:
        _check_swa(rho, alpha)
        super().__init__(InRoundLinearLR(LocalUpdateRule(), rho), SWAServer(lr=alpha))  # x + α·Δ̄ = x + α(v − x)


@register("fedmoswa", paper="Liu et al., ICML 2025", backprops=1, comm=(2, 2), stateful_clients=True)
class FedMoSWA(Algorithm):
    """FedMoSWA: FedSWA with momentum-based stochastic control variates (``d = g − c_i + m``).

    Args:
        rho: ρ, the lr at the end of the round as a fraction of η_l (0 ≤ ρ ≤ 1; not in the paper, 0 as in the
            released code).
        alpha: α, the server's averaging weight (0 < α ≤ 1).
        gamma: γ, the server momentum step ``m ← m + γ·mean(c_i⁺ − m)`` (0 ≤ γ ≤ 1; not in the paper, 0.4 as in
            the released code).
        first_round: "paper" (γ in every round) or "released" (γ = 1 in round 0: ``m₁ = mean_S c_i⁺``).
        control_divisor: "paper" (``Σ_k η_k``) or "released" (``K·η_l·(1 + ρ)/2``, the unreachable released
            ``update_FedMoSWA``).
        clip_order: "paper" (clip ``d``) or "released" (clip ``g`` alone, then add ``m − c_i``).
    """

    def __init__(self, rho: float = 0.0, alpha: float = 1.0, gamma: float = 0.4,
                 first_round: Literal["paper", "released"] = "paper",
                 control_divisor: Literal["paper", "released"] = "paper",
                 clip_order: Literal["paper", "released"] = "paper") -> None:
        _check_swa(rho, alpha)
        check(0 <= gamma <= 1, f"`algorithm.gamma` must be in [0, 1], got {gamma}")
        correction = MoSWACorrection(released("control_divisor", control_divisor), rho)
        client = ComposedClient(corrections=[correction], clip_gradient_first=released("clip_order", clip_order))
        first_gamma = 1.0 if released("first_round", first_round) else None
        super().__init__(InRoundLinearLR(client, rho), MoSWAServer(SWAServer(lr=alpha), gamma, first_gamma))
