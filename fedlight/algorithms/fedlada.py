"""FedLADA (Sun et al. 2023, "Efficient Federated Learning via Local Adaptive Amended Optimizer with Linear
Speedup"), the locally amended Adam.

State (server): the last global step ``m̃ = Δ̄_{r−1}/η_{r−1}`` and ``v̄``, the element-wise mean of the clients'
final Adam second moments; both start at zero.
  broadcast     x_r, m̃, v̄                                                       (3 model vectors)
  client        Adam with lr (1 − γ)·η_r, m_0 = 0, v_0 = v̄, no bias correction; per step, after clipping g,
                  g ← g + wd·y                                  (coupled L2, the loop's ``weight_decay``)
                  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²
                  y ← y − (1 − γ)·η·m/(√v + ε)                   (Adam step)
                  y ← y + γ·η·m̃/K                                (local amendment)
  upload        Δ_i and v_i (the final second moment)                             (2 model vectors)
  server        x ← x + Δ̄;  v̄ ← mean v_i;  m̃ ← Δ̄/η_r
The two lines of the local step are applied as one update ``y ← y − η·((1 − γ)·m/(√v + ε) − γ·m̃/K)`` by
:class:`AmendedAdam` (identical math), so ``param_groups[0]["lr"]`` stays η_r. The moment initialisation and
the absence of bias correction are exact (the released code emulates the latter with ``step = 1e6``).

λ is the loop's ``weight_decay`` (``ctx.weight_decay``), coupled L2 after clipping. Released-code differences:
``docs/algorithms.md`` (Baselines).

Round 0 (``first_round``). The paper's rule has one form for every round, with the server state starting at
zero (ALGORITHMS.md): round 0 therefore runs with v_0 = v̄ = 0 and no bias correction, and its k-th step is
(1 − β1^k)/√(1 − β2^k) times a bias-corrected Adam step for gradients of constant sign (4.45× at K = 4, ~5.6×
at K = 50). That is the default, ``first_round="paper"``. The released code's first round is an ordinary Adam:
its state injection (``step = 1e6``, v = v̄) is skipped while no gradient exists yet, which is an accident of the
implementation, not a written rule; ``first_round="released"`` reproduces it: round 0 bias-corrects m and v with
the local k (m_0 = v_0 = 0; m̃ = 0 anyway), every later round is the paper's.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from fedlight.algorithms.compose import released, values
from fedlight.core import params as P
from fedlight.core.params import Params
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, Broadcast, LocalUpdateRule, ServerRule
from fedlight.core.scale import Scale
from fedlight.errors import check


class AmendedAdam(torch.optim.Optimizer):
    """Adam whose moments, bias corrections and an added constant direction are set per round.

    One step, with ``g`` the (already clipped) ``.grad`` and ``k`` the local step (1-based)::

        g ← g + λ·y                                  (coupled L2, when ``decoupled`` is False)
        m ← β1·m + (1 − β1)·g;   v ← β2·v + (1 − β2)·g²
        m̂ = m/c1;   v̂ = v/c2                        (c = 1, 1 − β^k or 1 − β^(t0 + k), per ``bias1/bias2``)
        y ← y − η·(a·m̂/(√v̂ + ε) + b + λ·y)          (b: the per-round direction; λ·y only when ``decoupled``)

    Used by FedLADA (``a = 1 − γ``, ``b = −γ·m̃/K``, no bias correction) and FedAdamW (``a = 1``,
    ``b = α·Δ_G``, local bias correction for m and global for v). Call :meth:`begin_round` before the
    first step.

    Args:
        params: the tensors to update (the client's live parameters).
        lr: η.
        beta1: β1.
        beta2: β2.
        eps: ε.
        weight_decay: λ.
        decoupled: decoupled decay (AdamW) instead of coupled L2.
        adam_scale: a.
        bias1: bias correction of m: "off", "local" (k) or "global" (t0 + k).
        bias2: bias correction of v: "off", "local" or "global".
    """

    def __init__(self, params, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = True, adam_scale: float = 1.0, bias1: str = "off",
                 bias2: str = "off") -> None:
        super().__init__(params, {"lr": lr})
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.weight_decay, self.decoupled, self.adam_scale = weight_decay, decoupled, adam_scale
        self.bias1, self.bias2 = bias1, bias2
        self.params_list: list[Tensor] = list(self.param_groups[0]["params"])
        self.m: list[Tensor] = []
        self.v: list[Tensor] = []
        self.extra: list[Tensor] | None = None
        self.k = 0
        self.t0 = 0

    def begin_round(self, v0: list[Tensor] | None = None, extra: list[Tensor] | None = None, t0: int = 0) -> None:
        """``m ← 0``, ``v ← v0`` (zeros when None), the direction ``b`` (None: 0) and the global step offset."""
        self.m = [torch.zeros_like(p) for p in self.params_list]
        self.v = ([torch.zeros_like(p) for p in self.params_list] if v0 is None
                  else [v.detach().to(p.dtype).clone() for v, p in zip(v0, self.params_list)])
        self.extra = extra
        self.k, self.t0 = 0, int(t0)

    def _correction(self, beta: float, mode: str) -> float:
        if mode == "off":
            return 1.0
        return 1.0 - beta ** (self.k if mode == "local" else self.t0 + self.k)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.m:
            self.begin_round()
        ps, lr = self.params_list, self.param_groups[0]["lr"]
        g = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
        self.k += 1
        if self.weight_decay and not self.decoupled:
            g = torch._foreach_add(g, ps, alpha=self.weight_decay)  # g ← g + λ·y (coupled L2)
        torch._foreach_mul_(self.m, self.beta1)
        torch._foreach_add_(self.m, g, alpha=1 - self.beta1)  # m ← β1·m + (1 − β1)·g
        torch._foreach_mul_(self.v, self.beta2)
        torch._foreach_addcmul_(self.v, g, g, value=1 - self.beta2)  # v ← β2·v + (1 − β2)·g²
        c1, c2 = self._correction(self.beta1, self.bias1), self._correction(self.beta2, self.bias2)
        denom = torch._foreach_div(self.v, c2)  # v̂ = v/c2
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, self.eps)  # √v̂ + ε
        upd = torch._foreach_div(self.m, denom)
        torch._foreach_mul_(upd, self.adam_scale / c1)  # a·m̂ ⊙ ϑ
        if self.extra is not None:
            torch._foreach_add_(upd, self.extra)  # + b
        if self.weight_decay and self.decoupled:
            torch._foreach_add_(upd, ps, alpha=self.weight_decay)  # + λ·y (decoupled)
        torch._foreach_add_(ps, upd, alpha=-lr)  # y ← y − η·(...)
        return loss


class LadaClient(LocalUpdateRule):
    """Adam (lr (1 − γ)η, m_0 = 0, v_0 = v̄, no bias correction) plus the amendment ``y ← y + γ·η·m̃/K``.

    ``fresh_first_round``: round 0 bias-corrects m and v with the local k (the released code's first round)."""

    def __init__(self, gamma: float, beta1: float, beta2: float, eps: float, fresh_first_round: bool = False) -> None:
        self.gamma, self.beta1, self.beta2, self.eps = gamma, beta1, beta2, eps
        self.fresh_first_round = fresh_first_round

    def make_optimizer(self, params, lr, default):
        return AmendedAdam(params, lr, self.beta1, self.beta2, self.eps, weight_decay=0.0, decoupled=False,
                           adam_scale=1 - self.gamma)  # lr (1 − γ)·η; λ is set in start

    def start(self, model, ctx):
        super().start(model, ctx)
        ctx.optimizer.weight_decay = ctx.weight_decay  # the loop's λ, coupled L2
        bc = ctx.broadcast
        b = torch._foreach_mul(values(bc.extras["m_tilde"], ctx.params), -self.gamma / ctx.num_steps)  # −γ·m̃/K
        ctx.optimizer.begin_round(v0=values(bc.extras["v_bar"], ctx.params), extra=b)  # m_0 = 0, v_0 = v̄
        fresh = self.fresh_first_round and ctx.round == 0  # released: a plain bias-corrected Adam (v̄ = m̃ = 0)
        ctx.optimizer.bias1 = ctx.optimizer.bias2 = "local" if fresh else "off"

    def finish(self, model, ctx):
        result = super().finish(model, ctx)
        result.extras["v"] = dict(zip(ctx.params, (v.detach().clone() for v in ctx.optimizer.v)))  # v_i
        return result


class LadaServer(ServerRule):
    """``x ← x + Δ̄``; ``v̄ ← mean v_i``; ``m̃ ← Δ̄/η_r``; broadcast x, m̃, v̄."""

    state_keys = ("m_tilde", "v_bar")

    def setup(self, params: Params) -> None:
        self.m_tilde = P.zeros_like(params)
        self.v_bar = P.zeros_like(params)

    def broadcast(self, params, info, client_id) -> Broadcast:
        return Broadcast(params, extras={"m_tilde": self.m_tilde, "v_bar": self.v_bar})

    def update(self, params, agg, info):
        self.v_bar = dict(agg.extras["v"])  # v̄ ← mean_S v_i
        self.m_tilde = P.scale(agg.delta, 1.0 / info.lr)  # m̃ ← Δ̄/η_r
        return P.add(params, agg.delta)  # x ← x + Δ̄

    def diagnostics(self) -> dict[str, Any]:
        return {"m_tilde_norm": float(P.norm(self.m_tilde)),
                "v_bar_mean": float(sum(v.double().sum() for v in self.v_bar.values()) / max(P.numel(self.v_bar), 1))}


@register("fedlada", paper="Sun et al., arXiv:2308.00522 (2023)", backprops=1, comm=(3, 2))
class FedLADA(Algorithm):
    """FedLADA, locally amended Adam.

    The local learning rate η is ``loop.lr`` (the seed papers use 3e-4); the Adam step uses (1 − γ)·η.
    Weight decay is ``loop.weight_decay`` as coupled L2 (the released code: 1e-3).

    Args:
        gamma: γ, weight of the global amendment m̃ in [0, 1) (the released code hard-codes 0.9).
        beta1: β1 of the local Adam, in [0, 1).
        beta2: β2 of the local Adam, in [0, 1).
        eps: ε of the local Adam (> 0).
        first_round: "paper" (round 0 like every round: v̄ = 0, no bias correction) or "released" (round 0 is a
            bias-corrected Adam, as the released code's first round).
    """

    scales = (Scale("loop.lr", paper=3e-4, low=1e-6, high=1e-2),)  # Adam-scale lr: fedlight.config.advice

    def __init__(self, gamma: float = 0.9, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 first_round: Literal["paper", "released"] = "paper") -> None:
        check(0 <= gamma < 1, f"`algorithm.gamma` must be in [0, 1), got {gamma}")
        check(0 <= beta1 < 1, f"`algorithm.beta1` must be in [0, 1), got {beta1}")
        check(0 <= beta2 < 1, f"`algorithm.beta2` must be in [0, 1), got {beta2}")
        check(eps > 0, f"`algorithm.eps` must be > 0, got {eps}")
        super().__init__(LadaClient(gamma, beta1, beta2, eps, released("first_round", first_round)), LadaServer(1.0))
