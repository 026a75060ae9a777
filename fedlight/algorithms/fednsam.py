"""FedNSAM and its -S/-D variants (Liu et al., ACM MM 2025, "FedNSAM: Consistency of Local and Global Flatness
for Federated Learning", arXiv:2602.23827), Algorithm 1 (eqs. 12–13). One backprop per local step.

State: server momentum ``m`` (zeros). ``λ = 0.85``, ``ρ = 0.1``.
  broadcast          x_r and m
  local step k       ỹ = y_k + λ·m                                         (extrapolate, eq. 12)
                     δ = −ρ·m/‖m‖   (0 when m = 0)                          (perturb, eq. 13)
                     d = ∇ℓ(ỹ + δ)                                          (one backprop)
                     y_{k+1} = y_k − η·d  (SGD, wd, clip as usual)
  upload             Δ_i = y_{i,K} − x_r
  server             m ← λ·m + Δ̄;  x ← x + m
``m`` accumulates updates (downhill), so ``δ`` is an ascent along the global momentum. Both offsets are constant
within the round: :class:`NesterovPerturbation` adds ``e = λm + δ`` before the single forward/backward.

Variants (Table 5; the composition is fedlight's, the paper gives none):
  FedNSAM-S   d = ∇ℓ(ỹ + δ) + c − c_i;  c_i⁺ = c_i − c + (x_r − y_{i,K})/(Kη);
              server m ← λm + Δ̄; x ← x + m; c ← c + (1/N)·Σ_{i∈S} Δc_i                       (comm 3/2)
  FedNSAM-D   d = ∇ℓ(ỹ + δ) − ∇L_i + α(y − x_r);  ∇L_i ← ∇L_i − α·Δ_i;
              server h ← h − α(|S|/N)Δ̄; m ← λm + Δ̄; x ← x + m − h/α  (plain means over S)    (comm 2/1)
``lam=0, rho=0`` gives FedAvg, SCAFFOLD and FedDyn exactly. Ablations (Table 6: ``extrapolate``, ``rho=0``,
``perturbation="local_sam"``), the released code and reproduction notes: ``docs/algorithms.md`` (FedNSAM).
``perturbation="released"`` (the same client as ``local_sam``) is the released client: y_0 = x_r + λm once, then
local-gradient SAM (ρ_s = 0.05, two backprops) at every step, m = 0 included. The released servers' two bugs
(momentum forgotten every round; the July-2025 look-ahead never applied) are documented there, not offered.
"""

from __future__ import annotations

from typing import Literal

from fedlight.algorithms.compose import ComposedClient, Perturbation
from fedlight.algorithms.fedavgm import MomentumServer
from fedlight.algorithms.feddyn import DynCorrection, DynServer
from fedlight.algorithms.fedsam import SAMPerturbation
from fedlight.algorithms.scaffold import ScaffoldCorrection, ScaffoldServer
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, Broadcast
from fedlight.errors import check


class NesterovPerturbation(Perturbation):
    """``e = λ·m + δ`` with ``δ = −ρ·m/‖m‖``, fixed for the round (no extra backprop).

    Args:
        lam: λ, the extrapolation coefficient.
        rho: ρ, the perturbation radius.
        extrapolate: add ``λm`` (``False``: "FedNSAM − Nesterov", ``e = δ``).
    """

    needs_true_grad_norm = False  # a norm of a parameter difference, not of a gradient

    uses_backprop = False

    def __init__(self, lam: float, rho: float, extrapolate: bool = True) -> None:
        self.lam, self.rho, self.extrapolate = lam, rho, extrapolate

    def start(self, model, ctx):
        m = ctx.broadcast.extras["m"]
        delta = P.scale(P.unit(m), -self.rho)  # δ = −ρ·m/‖m‖ (0 when m = 0)
        e = P.add(delta, m, self.lam) if self.extrapolate else delta  # e = λm + δ, so y + e = ỹ + δ
        ctx.scratch["nsam_e"] = e
        ctx.metrics["perturbation_norm"] = P.norm(delta)  # ‖δ‖ (ρ, or 0 while m = 0)
        ctx.metrics["offset_norm"] = P.norm(e)  # ‖λm + δ‖

    def __call__(self, model, batch, ctx):
        return ctx.scratch["nsam_e"], None  # d = ∇ℓ(y + e) is taken by ComposedClient


class NesterovServer(MomentumServer):
    """``m ← λ·m + Δ̄; x ← x + m`` (FedAvgM's server with β = λ, η_g = 1) that also sends the momentum.

    Args:
        lam: λ.
        send: ``"m"`` broadcasts ``x_r`` and ``m`` (FedNSAM); ``"lookahead"`` broadcasts the single start
            point ``x_r + λm`` (the released client); ``"x"`` broadcasts ``x_r`` only.
    """

    def __init__(self, lam: float, send: Literal["m", "lookahead", "x"] = "m") -> None:
        super().__init__(beta=lam, lr=1.0)
        self.send = send

    def broadcast(self, params, info, client_id):
        if self.send == "m":
            return Broadcast(params, extras={"m": self.m})
        if self.send == "lookahead":
            return Broadcast(P.add(params, self.m, self.beta))  # y_0 = x_r + λm
        return Broadcast(params)


def _check_common(lam: float, rho: float) -> None:
    check(0 <= lam < 1, f"`algorithm.lam` must be in [0, 1), got {lam}")
    check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")


def _nsam_client(lam: float, rho: float, extrapolate: bool, corrections=()) -> ComposedClient:
    return ComposedClient(NesterovPerturbation(lam, rho, extrapolate), corrections)


@register("fednsam", paper="Liu et al., ACM MM 2025", backprops=1, comm=(2, 1))
class FedNSAM(Algorithm):
    """FedNSAM: global Nesterov momentum as look-ahead and as the sharpness-perturbation direction.

    Args:
        lam: λ, server momentum and extrapolation coefficient (0 ≤ λ < 1).
        rho: ρ, radius of the momentum-direction perturbation ``δ = −ρ·m/‖m‖`` (≥ 0; ``lam=0, rho=0`` is FedAvg).
        extrapolate: evaluate gradients at the look-ahead ``y + λm`` (``False``: Table 6's "FedNSAM − Nesterov").
        perturbation: ``momentum`` (the paper, one backprop) or ``local_sam`` (the released code: start once
            from ``x_r + λm``, then local-gradient SAM with ``sam_rho``, two backprops, 1 model down; ``rho``
            unused). ``local_sam`` is also Table 6's "FedSAM + Nesterov". ``released`` is the same client under
            the spelling every rule uses for its released form (with the default ``sam_rho`` 0.05 and
            ``extrapolate``, the released ``update_NSAM`` exactly, even while m = 0).
        sam_rho: SAM radius of ``perturbation=local_sam``/``released`` (≥ 0; the released code hard-codes 0.05).
    """

    def __init__(self, lam: float = 0.85, rho: float = 0.1, extrapolate: bool = True,
                 perturbation: Literal["momentum", "local_sam", "released"] = "momentum",
                 sam_rho: float = 0.05) -> None:
        _check_common(lam, rho)
        check(perturbation in ("momentum", "local_sam", "released"),
              f"`algorithm.perturbation` must be 'momentum', 'local_sam' or 'released', got {perturbation!r}")
        check(sam_rho >= 0, f"`algorithm.sam_rho` must be >= 0, got {sam_rho}")
        if perturbation == "momentum":
            super().__init__(_nsam_client(lam, rho, extrapolate), NesterovServer(lam, "m"))
        else:  # released client: y_0 = x_r + λm once, SAM steps, Δ_i = y_{i,K} − y_0
            super().__init__(ComposedClient(SAMPerturbation(sam_rho)),
                             NesterovServer(lam, "lookahead" if extrapolate else "x"))


@register("fednsam_s", paper="Liu et al., ACM MM 2025 (FedNSAM-S)", backprops=1, comm=(3, 2), stateful_clients=True)
class FedNSAMS(Algorithm):
    """FedNSAM-S: FedNSAM plus SCAFFOLD's control variates (``d += c − c_i``, SCAFFOLD server around the momentum).

    Args:
        lam: λ, server momentum and extrapolation coefficient (0 ≤ λ < 1).
        rho: ρ, radius of the momentum-direction perturbation (≥ 0).
        extrapolate: evaluate gradients at the look-ahead ``y + λm``.
    """

    def __init__(self, lam: float = 0.85, rho: float = 0.1, extrapolate: bool = True) -> None:
        _check_common(lam, rho)
        super().__init__(_nsam_client(lam, rho, extrapolate, [ScaffoldCorrection()]),
                         ScaffoldServer(NesterovServer(lam, "m")))


@register("fednsam_d", paper="Liu et al., ACM MM 2025 (FedNSAM-D)", backprops=1, comm=(2, 1), stateful_clients=True)
class FedNSAMD(Algorithm):
    """FedNSAM-D: FedNSAM plus FedDyn's dynamic regularization (FedDyn server around the momentum).

    Args:
        lam: λ, server momentum and extrapolation coefficient (0 ≤ λ < 1).
        rho: ρ, radius of the momentum-direction perturbation (≥ 0).
        alpha: α, FedDyn's regularization coefficient (> 0).
        extrapolate: evaluate gradients at the look-ahead ``y + λm``.
    """

    def __init__(self, lam: float = 0.85, rho: float = 0.1, alpha: float = 0.1, extrapolate: bool = True) -> None:
        _check_common(lam, rho)
        check(alpha > 0, f"`algorithm.alpha` must be > 0, got {alpha}")
        super().__init__(_nsam_client(lam, rho, extrapolate, [DynCorrection(alpha)]),
                         DynServer(NesterovServer(lam, "m"), alpha))
