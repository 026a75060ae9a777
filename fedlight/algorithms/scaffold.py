"""SCAFFOLD, option II (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for FL").

State: server ``c``; per-client ``c_i`` (zeros), kept by client id across rounds.
  client step        d = g + c − c_i                                   (Alg. 1 L10)
  after K steps      c_i⁺ = c_i − c + (x_r − y_{i,K}) / (K·η_r)        (L12, option II)
  upload             Δ_i and Δc_i = c_i⁺ − c_i;  store c_i ← c_i⁺      (L13)
  server             x ← x + η_g·Δ̄;  c ← c + (1/N)·Σ_{i∈S} Δc_i        (L16-17)
``K·η_r`` is the sum of the learning rates actually used (``ctx.lr_sum``), which is K·η_r for a constant
in-round lr — K counts local steps, not steps per epoch. The correction is part of ``d`` (a true gradient
term, inside the clip), not a detached number added to the loss as in some released code.
"""

from __future__ import annotations

import torch

from fedlight.algorithms.compose import ComposedClient, Correction, ServerWrapper, state_params, values
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ServerRule
from fedlight.errors import check


class ScaffoldCorrection(Correction):
    """``d += scale·(c − c_i)`` and the option-II control-variate update.

    Args:
        scale: λ_c multiplying the correction (1 in SCAFFOLD/FedGAMMA; FedLESAM-S's official runs used 0.1).
    """

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def start(self, model, ctx):
        c, c_i = ctx.broadcast.extras["c"], state_params(ctx, "c_i")
        gap = P.sub(c, c_i)
        ctx.scratch["c-c_i"] = values(gap, ctx.params)
        ctx.metrics["control_gap_norm"] = P.norm(gap)  # ‖c − c_i‖

    def add(self, ctx, d):
        torch._foreach_add_(d, ctx.scratch["c-c_i"], alpha=self.scale)  # d += c − c_i

    def lr_sum(self, ctx) -> float:
        """The divisor of the option-II update: ``Σ_k η_k``, the learning rates actually used."""
        return ctx.lr_sum

    def finish(self, ctx, result):
        c, c_i = ctx.broadcast.extras["c"], ctx.state["c_i"]
        c_i_new = P.lincomb([(1.0, c_i), (-1.0, c), (-1.0 / self.lr_sum(ctx), result.delta)])  # c_i − c + (x − y)/(Kη)
        result.extras["delta_c"] = P.sub(c_i_new, c_i)  # Δc_i
        ctx.state["c_i"] = c_i_new


class ScaffoldServer(ServerWrapper):
    """Adds ``c`` to the inner server: broadcast ``c``; after the inner update ``c ← c + (1/N)·Σ Δc_i``."""

    state_keys = ("c",)
    summed_extras = frozenset({"delta_c"})

    def setup(self, params):
        super().setup(params)
        self.c = P.zeros_like(params)

    def broadcast(self, params, info, client_id):
        bc = super().broadcast(params, info, client_id)
        bc.extras["c"] = self.c
        return bc

    def update(self, params, agg, info):
        x = super().update(params, agg, info)
        self.c = P.add(self.c, agg.extras["delta_c"], 1.0 / info.num_clients)  # c ← c + (1/N)·Σ Δc_i
        return x

    def diagnostics(self):
        return {**super().diagnostics(), "c_norm": float(P.norm(self.c))}


@register("scaffold", paper="Karimireddy et al., ICML 2020", backprops=1, comm=(2, 2), stateful_clients=True)
class SCAFFOLD(Algorithm):
    """SCAFFOLD (option II control variates).

    Args:
        server_lr: η_g.
    """

    def __init__(self, server_lr: float = 1.0) -> None:
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        super().__init__(ComposedClient(corrections=[ScaffoldCorrection()]), ScaffoldServer(ServerRule(server_lr)))
