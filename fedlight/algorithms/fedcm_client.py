"""FedCM with persistent per-client momentum buffers (the seed documentation's "FedCM" description).

Not Xu et al.'s FedCM (that is ``fedcm``): here every client ``k`` keeps its own heavy-ball buffer ``v_k``, which
belongs to the client id and persists across rounds, including the rounds it is not sampled.
  client step        g ← clip(∇ℓ(y), G);   v_k ← β·v_k + g;   y ← y − η·(v_k + wd·y)
  server             x ← x + η_g·Δ̄   (FedAvg, Δ̄ weighted by n_k)
``v_k`` starts at zero the first time client ``k`` trains (round 0 for the clients sampled then).
``β = 0`` is FedAvg exactly.

Clipping (a choice, documented): the gradient is clipped to ``max_grad_norm`` = G *before* it enters the buffer and
the step uses ``v_k`` unclipped (``ctx.apply(clip=False)``). By induction ‖v_k‖ ≤ β·G/(1 − β) + G = G/(1 − β),
the bound the specification requires; clipping ``v_k`` itself instead would give ‖v_k‖ ≤ G but a buffer that no
longer is the geometric sum of past gradients. Weight decay stays the optimizer's (coupled SGD: ``wd·y`` is added
to the step direction after the buffer update, and never enters ``v_k``).

Diagnostics the page promises (``server/…``, per round, over the sampled clients S, uniform weights, buffers
measured after the client's K steps): ``momentum_beta`` = β; ``avg_momentum_norm`` = mean_S ‖v_k‖;
``momentum_variance`` = "variance in client momenta", the population variance of the vectors,
mean_S ‖v_k − v̄‖² = mean_S ‖v_k‖² − ‖v̄‖² with v̄ = mean_S v_k (clamped at 0 against round-off); ``effective_lr`` =
η_r/(1 − β), the step size of a constant gradient once the buffer has saturated. The server needs the vectors for
that variance (the page's implementation keeps the buffers at the aggregator), so each client uploads ``v_k``
besides ``Δ_k``: comm 1/2. ``momentum_variance="norms"`` uploads ``Δ_k`` alone and reports Var_S ‖v_k‖ instead.

Default β = 0.5: the page's "default" range is [0.5, 0.9), and 0.5 is the one value of that range it tabulates.

The buffer replaces the local optimizer's own momentum: keep ``loop.momentum = 0`` (the default).
Memory: one model-sized buffer per client, held in the loop's per-client store (``loop.state_device: cpu`` by
default, so it lives off the accelerator).
"""

from __future__ import annotations

from typing import Literal

import torch

from fedlight.algorithms.compose import ServerWrapper, state_params, values
from fedlight.core import params as P
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, LocalUpdateRule, ServerRule
from fedlight.errors import check


class ClientMomentumSGD(LocalUpdateRule):
    """Heavy-ball SGD whose buffer ``v_k = ctx.state["v"]`` persists per client across rounds.

    Args:
        beta: β, the buffer's decay (0 ≤ β < 1).
    """

    def __init__(self, beta: float, upload: bool = True) -> None:
        self.beta, self.upload = beta, upload

    def start(self, model, ctx):
        super().start(model, ctx)  # y_0 = x_r
        ctx.scratch["v"] = values(state_params(ctx, "v"), ctx.params)  # v_k (zeros on first participation)

    def step(self, model, batch, ctx):
        loss = ctx.forward_backward(model, batch)
        g = list(ctx.grads().values())
        v = ctx.scratch["v"]
        with torch.no_grad():
            P.joint_clip_(g, ctx.max_grad_norm)  # ‖g‖ ≤ G before it enters the buffer
            torch._foreach_mul_(v, self.beta)  # v_k ← β·v_k
            torch._foreach_add_(v, g)  # v_k ← β·v_k + g
            torch._foreach_copy_(g, v)  # d = v_k
        ctx.apply(clip=False)  # y ← y − η·(v_k + wd·y); ‖v_k‖ ≤ G/(1 − β) already
        return loss

    def finish(self, model, ctx):
        result = super().finish(model, ctx)
        sq = P.sqnorm(ctx.state["v"])
        result.metrics["momentum_norm"] = sq.sqrt()  # ‖v_k‖
        result.metrics["momentum_sqnorm"] = sq  # ‖v_k‖²
        if self.upload:
            result.extras["v"] = P.clone(ctx.state["v"])  # for the server's variance of the vectors
        return result


class MomentumStatsServer(ServerWrapper):
    """Turns the clients' averaged ``momentum_norm``/``momentum_sqnorm`` metrics (and, with ``vectors``, the summed
    uploads ``Σ_S v_k``) into per-round diagnostics."""

    summed_extras = frozenset({"v"})  # Σ_S v_k; divided by |S| here, so v̄ is the plain mean whatever the weighting

    def __init__(self, inner: ServerRule, beta: float, vectors: bool = True) -> None:
        super().__init__(inner)
        self.beta, self.vectors = beta, vectors
        self._stats: dict[str, float] = {}

    def update(self, params, agg, info):
        mean_norm = float(agg.metrics["momentum_norm"])
        mean_sq = float(agg.metrics["momentum_sqnorm"])
        if self.vectors:
            v_bar_sq = float(P.sqnorm(agg.extras["v"])) / len(info.sampled) ** 2  # ‖v̄‖², v̄ = (1/|S|)·Σ_S v_k
            variance = max(mean_sq - v_bar_sq, 0.0)  # mean_S ‖v_k − v̄‖²
        else:
            variance = max(mean_sq - mean_norm**2, 0.0)  # Var_S ‖v_k‖
        self._stats = {
            "momentum_beta": self.beta,
            "avg_momentum_norm": mean_norm,  # mean_S ‖v_k‖
            "momentum_variance": variance,
            "effective_lr": info.lr / (1.0 - self.beta),  # η_r/(1 − β)
        }
        return super().update(params, agg, info)

    def diagnostics(self):
        return {**super().diagnostics(), **self._stats}


@register("fedcm_client", paper="FedCM (Xu et al., arXiv:2106.10874) with per-client momentum", backprops=1,
          comm=(1, 2), stateful_clients=True)
class FedCMClient(Algorithm):
    """FedCM with persistent per-client momentum buffers: ``v_k ← β·v_k + g``, ``y ← y − η·v_k``; server FedAvg.

    The gradient is clipped before it enters the buffer (so ‖v_k‖ ≤ max_grad_norm/(1 − β)); the step itself is
    not clipped again. Download ``x_r`` (1), upload ``Δ_k`` and ``v_k`` (2; 1 with ``momentum_variance="norms"``).

    Args:
        beta: β, the per-client momentum (0 ≤ β < 1; 0 is FedAvg; default 0.5, the page's default range [0.5, 0.9)).
        server_lr: η_g.
        momentum_variance: ``"vectors"``: the page's variance of the client momenta, mean_S ‖v_k − v̄‖² (uploads
            ``v_k``); ``"norms"``: Var_S ‖v_k‖ (no extra upload).
    """

    def __init__(self, beta: float = 0.5, server_lr: float = 1.0,
                 momentum_variance: Literal["vectors", "norms"] = "vectors") -> None:
        check(0 <= beta < 1, f"`algorithm.beta` must be in [0, 1), got {beta}")
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        check(momentum_variance in ("vectors", "norms"),
              f"`algorithm.momentum_variance` must be 'vectors' or 'norms', got {momentum_variance!r}")
        vectors = momentum_variance == "vectors"
        super().__init__(ClientMomentumSGD(beta, upload=vectors),
                         MomentumStatsServer(ServerRule(server_lr), beta, vectors))
