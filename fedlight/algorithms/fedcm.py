"""FedCM (Xu et al. 2021, "FedCM: Federated Learning with Client-level Momentum", arXiv:2106.10874).

State: the server keeps the last global pseudo-gradient ``G`` (zeros in round 0) and broadcasts it with ``x_r``.
  client step        d = α·g + (1 − α)·G                    (Alg. 1: v = α∇f_i(y) + (1 − α)Δ_r)
  server             x ← x + η_g·Δ̄;   G ← −Δ̄/(K·η_r)       (Alg. 1: Δ_{r+1} = −Δ̄/(Kη))
``α`` is the weight on the fresh gradient (0.1 in the papers that compare against FedCM); the mix is part of
``d`` and therefore inside the clip (the paper writes no clip; ALGORITHMS.md §0 clips the direction taken).
``clip_order="released"`` clips the gradient alone first, as the released code does:
``d = α·clip(g) + (1 − α)·G``. In round 0, ``G = 0``, so the first round moves at ``α·η`` (as the released
FL-Simulator code does). ``α = 1`` is FedAvg exactly.

The two pieces are reusable: :class:`MomentumCorrection` (``d += s·G`` for a global direction the client
receives or computes) and :class:`PseudoGradientServer` (keeps and broadcasts ``G = −Δ̄/(Kη_r)``), used by
MoFedSAM and FedWMSAM.
"""

from __future__ import annotations

from typing import Literal

import torch

from fedlight.algorithms.compose import ComposedClient, Correction, ServerWrapper, released, values
from fedlight.core import params as P
from fedlight.core.params import Params
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


class MomentumCorrection(Correction):
    """``d += s·G``: a global direction mixed into the local one (FedCM's ``(1 − α)·G``).

    By default ``G`` is the broadcast extra ``key`` and ``s`` the constant ``scale``. Rules whose direction or
    weight changes per client or per round (FedWMSAM's ``(1 − α_r)·u_i``) override :meth:`direction` /
    :meth:`weight`; both are read once per client in :meth:`start`.

    Args:
        scale: s, the weight of ``G`` in ``d`` (``1 − α`` in FedCM; 0 adds nothing).
        key: the name of the broadcast extra that holds ``G``.
    """

    def __init__(self, scale: float = 1.0, key: str = "G") -> None:
        self.scale = scale
        self.key = key

    def direction(self, ctx) -> Params:
        """``G`` for this client's round."""
        return ctx.broadcast.extras[self.key]

    def weight(self, ctx) -> float:
        """``s`` for this client's round."""
        return self.scale

    def start(self, model, ctx):
        s = float(self.weight(ctx))
        ctx.scratch[f"mix/{self.key}"] = (s, values(self.direction(ctx), ctx.params) if s else None)

    def add(self, ctx, d):
        s, G = ctx.scratch[f"mix/{self.key}"]
        if s:
            torch._foreach_add_(d, G, alpha=s)  # d += (1 − α)·G


class PseudoGradientServer(ServerWrapper):
    """Keeps the round's pseudo-gradient ``G ← −Δ̄/(K·η_r)`` (zeros before round 0) and broadcasts it.

    The value broadcast in round ``r`` is the one computed from round ``r − 1``'s ``Δ̄`` with that round's
    ``K`` (``RoundInfo.num_steps``, the mean over S_r) and ``η``. The state attribute is named after ``key``
    (``server.G`` for FedCM, ``server.M`` for FedWMSAM).

    Args:
        inner: the server rule that updates ``x`` (FedAvg: ``x ← x + η_g·Δ̄``).
        key: the name of the broadcast extra and of the state attribute.
    """

    def __init__(self, inner: ServerRule, key: str = "G") -> None:
        super().__init__(inner)
        self.key = key
        self.state_keys = (key,)

    def current(self) -> Params:
        """The ``G`` the next broadcast sends."""
        return getattr(self, self.key)

    def setup(self, params):
        super().setup(params)
        setattr(self, self.key, P.zeros_like(params))  # G = 0 in round 0

    def broadcast(self, params, info, client_id):
        bc = super().broadcast(params, info, client_id)
        bc.extras[self.key] = self.current()
        return bc

    def update(self, params, agg, info):
        x = super().update(params, agg, info)
        setattr(self, self.key, P.scale(agg.delta, -1.0 / (info.num_steps * info.lr)))  # G ← −Δ̄/(K·η_r)
        return x

    def diagnostics(self):
        return {**super().diagnostics(), f"{self.key}_norm": float(P.norm(self.current()))}


def check_alpha(alpha: float) -> None:
    check(0 < alpha <= 1, f"`algorithm.alpha` must be in (0, 1], got {alpha}")


@register("fedcm", paper="Xu et al., arXiv:2106.10874 (2021)", backprops=1, comm=(2, 1))
class FedCM(Algorithm):
    """FedCM: client-level momentum with the server's last pseudo-gradient.

    Local step ``d = α·g + (1 − α)·G`` (``grad_scale = α`` plus ``MomentumCorrection(1 − α)``); server
    ``x ← x + η_g·Δ̄``, ``G ← −Δ̄/(K·η_r)``. Download ``x_r`` and ``G`` (2), upload ``Δ_i`` (1).

    Args:
        alpha: α, the weight of the fresh local gradient (0 < α ≤ 1; 1 is FedAvg).
        server_lr: η_g.
        clip_order: "paper": clip the whole direction ``d`` (``loop.max_grad_norm``); "released": clip the
            gradient alone before mixing, ``d = α·clip(g) + (1 − α)·G`` (the released code). Same while the clip
            is inactive.
    """

    def __init__(self, alpha: float = 0.1, server_lr: float = 1.0,
                 clip_order: Literal["paper", "released"] = "paper") -> None:
        check_alpha(alpha)
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        client = ComposedClient(corrections=[MomentumCorrection(1.0 - alpha)], grad_scale=alpha,
                                clip_gradient_first=released("clip_order", clip_order))
        super().__init__(client, PseudoGradientServer(ServerRule(server_lr)))
