"""FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization", the FedOpt family).

Clients are FedAvg (K local SGD steps). The server treats the averaged update ``Δ̄`` as a step of Adam
(Alg. 2 of the paper, with ``Δ_t`` = Δ̄):
  m ← β1·m + (1 − β1)·Δ̄                         (Alg. 2, m_t)
  v ← β2·v + (1 − β2)·Δ̄²                        (Alg. 2, v_t, FedAdam line)
  x ← x + η_s·m/(√v + τ)                         (Alg. 2, x_{t+1})
``m`` and ``v`` start at zero and there is no bias correction (the paper's Alg. 2 and the comparisons the
seed papers ran); ``bias_correction=True`` divides ``m`` by ``1 − β1^s`` and ``v`` by ``1 − β2^s`` after
``s`` server steps. Only trainable parameters go through Adam: the loop averages float BatchNorm buffers
itself and never averages integer buffers.

The released code (J family, ``apply_weights_adam``) forces η_s = 0.01 and uses β2 = 0.98 with m, v
initialised from the first Δ̄; the FL-Simulator code uses η_s = ``--global-learning-rate`` (default 1.0)
with β2 = 0.99. fedlight's defaults are ALGORITHMS.md's (η_s = 0.01, β2 = 0.99, τ = 0.01).
"""

from __future__ import annotations

import torch

from fedlight.core import params as P
from fedlight.core.params import Params
from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, ClientResult, LocalUpdateRule, RoundInfo, ServerRule
from fedlight.core.scale import Scale
from fedlight.errors import check


class AdamServer(ServerRule):
    """Server Adam on ``Δ̄`` (``m, v`` start at zero).

    Args:
        lr: η_s, the server learning rate.
        beta1: β1, first-moment decay.
        beta2: β2, second-moment decay.
        tau: τ, the adaptivity floor added to ``√v``.
        bias_correction: divide the moments by ``1 − β^s`` (``s`` = server steps taken).
    """

    state_keys = ("m", "v", "steps")

    def __init__(self, lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 0.01,
                 bias_correction: bool = False) -> None:
        super().__init__(lr)
        self.beta1, self.beta2, self.tau, self.bias_correction = beta1, beta2, tau, bias_correction
        self.steps = 0

    def setup(self, params: Params) -> None:
        self.m = P.zeros_like(params)
        self.v = P.zeros_like(params)
        self.steps = 0

    def update(self, params: Params, agg: ClientResult, info: RoundInfo) -> Params:
        d = list(agg.delta.values())
        keys = list(params)
        m, v = [self.m[k] for k in keys], [self.v[k] for k in keys]
        self.steps += 1
        with torch.no_grad():
            torch._foreach_mul_(m, self.beta1)
            torch._foreach_add_(m, d, alpha=1 - self.beta1)  # m ← β1·m + (1 − β1)·Δ̄
            torch._foreach_mul_(v, self.beta2)
            torch._foreach_addcmul_(v, d, d, value=1 - self.beta2)  # v ← β2·v + (1 − β2)·Δ̄²
            c1 = 1 - self.beta1 ** self.steps if self.bias_correction else 1.0
            c2 = 1 - self.beta2 ** self.steps if self.bias_correction else 1.0
            denom = torch._foreach_sqrt(torch._foreach_div(v, c2))
            torch._foreach_add_(denom, self.tau)  # √v̂ + τ
            step = torch._foreach_div(m, denom)
            x = torch._foreach_add([params[k] for k in keys], step, alpha=self.lr / c1)  # x ← x + η_s·m̂/(√v̂ + τ)
        return dict(zip(keys, x))

    def diagnostics(self) -> dict[str, float]:
        return {"m_norm": float(P.norm(self.m)), "v_norm": float(P.norm(self.v))}


@register("fedadam", paper="Reddi et al., ICLR 2021", backprops=1, comm=(1, 1))
class FedAdam(Algorithm):
    """FedAdam (FedOpt with a server Adam).

    Args:
        server_lr: η_s, the server Adam learning rate (> 0). The released J code forces 0.01.
        beta1: β1, server first-moment decay, in [0, 1).
        beta2: β2, server second-moment decay, in [0, 1).
        tau: τ, the adaptivity floor added to √v (> 0).
        bias_correction: bias-correct m and v as in Kingma & Ba (off in the paper's Alg. 2 and in the seeds'
            comparisons).
    """

    scales = (Scale("algorithm.server_lr", paper=0.01, low=1e-4, high=0.1, attr="server.lr"),)  # fedlight.config.advice

    def __init__(self, server_lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 0.01,
                 bias_correction: bool = False) -> None:
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        check(0 <= beta1 < 1, f"`algorithm.beta1` must be in [0, 1), got {beta1}")
        check(0 <= beta2 < 1, f"`algorithm.beta2` must be in [0, 1), got {beta2}")
        check(tau > 0, f"`algorithm.tau` must be > 0, got {tau}")
        super().__init__(LocalUpdateRule(), AdamServer(server_lr, beta1, beta2, tau, bias_correction))
