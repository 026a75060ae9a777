"""FedLESAM, FedLESAM-S, FedLESAM-D (Fan et al. 2024, "Locally Estimated Global Perturbations are Better than
Local Perturbations for Federated Sharpness-aware Minimization", ICML).

Clients perturb along an estimate of the *global* ascent direction, the opposite of the last global move,
instead of their local gradient, so a step costs one backprop:
  Δ_G = x_r − x_{r−1}                              broadcast by GlobalMoveServer (zero in round 0)
  e   = −ρ·Δ_G/‖Δ_G‖                               once per round, fixed for all K steps (zero when Δ_G = 0)
  d   = ∇ℓ(y + e)                                  one backprop; BN running stats updated by this pass
  FedLESAM     server FedAvg: x ← x + η_g·Δ̄
  FedLESAM-S   d += λ_c(c − c_i); SCAFFOLD control variates and server (ScaffoldCorrection/ScaffoldServer)
  FedLESAM-D   d += −∇L_i + α(y − x_r); FedDyn duals and server (DynCorrection/DynServer)
In every variant Δ_G is the server's whole move ``x_{r+1} − x_r`` (for -D it includes the −h/α part, as in the
released code). ``ρ = 0`` gives FedAvg / SCAFFOLD (λ_c = 1) / FedDyn exactly.
Communication (down/up): FedLESAM 2/1, -S 3/2, -D 2/1 (Δ_G is one extra vector down; a client that cached
x_{r−1} would not need it, but clients here are stateless for FedLESAM, so it is sent).

ρ defaults to 0.1, the released code's default. Released-code differences: ``docs/algorithms.md`` (Baselines).
"""

from __future__ import annotations

from fedlight.algorithms.compose import ComposedClient, Perturbation, ServerWrapper
from fedlight.algorithms.feddyn import DynCorrection, DynServer
from fedlight.algorithms.scaffold import ScaffoldCorrection, ScaffoldServer
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


class GlobalMoveServer(ServerWrapper):
    """Remembers the last global move ``Δ_G = x_r − x_{r−1}`` (zeros before the first update) and broadcasts it
    as ``extras[key]``. Wrap it outermost, so it sees the final ``x_{r+1}`` of whatever inner server it wraps.

    Args:
        inner: the server rule whose moves are remembered.
        key: name of the broadcast extra.
    """

    state_keys = ("move",)

    def __init__(self, inner: ServerRule, key: str = "global_move") -> None:
        super().__init__(inner)
        self.key = key

    def setup(self, params):
        super().setup(params)
        self.move = P.zeros_like(params)

    def broadcast(self, params, info, client_id):
        bc = super().broadcast(params, info, client_id)
        bc.extras[self.key] = self.move
        return bc

    def update(self, params, agg, info):
        x = super().update(params, agg, info)
        self.move = P.sub(x, params)  # Δ_G ← x_{r+1} − x_r
        return x

    def diagnostics(self):
        return {**super().diagnostics(), "global_move_norm": float(P.norm(self.move))}


class LESAMPerturbation(Perturbation):
    """``e = −ρ·Δ_G/‖Δ_G‖`` from the broadcast global move, computed once per round; no extra backprop."""

    needs_true_grad_norm = False  # a norm of a parameter difference, not of a gradient

    uses_backprop = False

    def __init__(self, rho: float, key: str = "global_move") -> None:
        self.rho = rho
        self.key = key

    def start(self, model, ctx):
        move = ctx.broadcast.extras[self.key]
        e = P.scale(P.unit(move), -self.rho)  # e = −ρ·(x_r − x_{r−1})/‖x_r − x_{r−1}‖  (0 when the move is 0)
        ctx.scratch["lesam_e"] = e
        ctx.metrics["perturbation_norm"] = P.norm(e)

    def __call__(self, model, batch, ctx):
        return ctx.scratch["lesam_e"], None


@register("fedlesam", paper="Fan et al., ICML 2024", backprops=1, comm=(2, 1))
class FedLESAM(Algorithm):
    """FedLESAM: SAM along the locally estimated global ascent direction, FedAvg server.

    Args:
        rho: ρ, perturbation radius (≥ 0; 0 is FedAvg). Official code default 0.1.
        server_lr: η_g.
    """

    def __init__(self, rho: float = 0.1, server_lr: float = 1.0) -> None:
        check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        super().__init__(ComposedClient(LESAMPerturbation(rho)), GlobalMoveServer(ServerRule(server_lr)))


@register("fedlesam_s", paper="Fan et al., ICML 2024", backprops=1, comm=(3, 2), stateful_clients=True)
class FedLESAM_S(Algorithm):
    """FedLESAM-S: FedLESAM with SCAFFOLD's correction ``λ_c(c − c_i)`` and SCAFFOLD server.

    Args:
        rho: ρ, perturbation radius (≥ 0).
        lam: λ_c, weight of the SCAFFOLD correction (≥ 0; 1 is SCAFFOLD's; the official runs used 0.1).
        server_lr: η_g.
    """

    def __init__(self, rho: float = 0.1, lam: float = 1.0, server_lr: float = 1.0) -> None:
        check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")
        check(lam >= 0, f"`algorithm.lam` must be >= 0, got {lam}")
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        local = ComposedClient(LESAMPerturbation(rho), [ScaffoldCorrection(lam)])  # d = ∇ℓ(y + e) + λ_c(c − c_i)
        super().__init__(local, GlobalMoveServer(ScaffoldServer(ServerRule(server_lr))))


@register("fedlesam_d", paper="Fan et al., ICML 2024", backprops=1, comm=(2, 1), stateful_clients=True)
class FedLESAM_D(Algorithm):
    """FedLESAM-D: FedLESAM with FedDyn's dynamic regularizer and server.

    Args:
        rho: ρ, perturbation radius (≥ 0).
        alpha: α, the FedDyn coefficient (> 0; the official code's ``--lamb`` 0.1).
    """

    def __init__(self, rho: float = 0.1, alpha: float = 0.1) -> None:
        check(rho >= 0, f"`algorithm.rho` must be >= 0, got {rho}")
        check(alpha > 0, f"`algorithm.alpha` must be > 0, got {alpha}")
        local = ComposedClient(LESAMPerturbation(rho), [DynCorrection(alpha)])  # d = ∇ℓ(y + e) − ∇L_i + α(y − x_r)
        super().__init__(local, GlobalMoveServer(DynServer(ServerRule(1.0), alpha)))
