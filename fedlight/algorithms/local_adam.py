"""Local Adam and Local AdamW: the common adaptive baseline of the FedAdamW / FedLADA comparisons.

Each sampled client runs K steps of a *fresh* ``torch.optim.Adam`` (coupled L2: ``g ← g + wd·y`` before
the moments) or ``torch.optim.AdamW`` (decoupled: ``y ← y − η·wd·y``), created anew every round by
:meth:`AdamClient.make_optimizer` — the loop's own optimizer setting (``loop.optimizer``,
``loop.weight_decay``, ``loop.momentum``) is ignored. Moments start at zero with the usual bias correction
(local step count k = 1..K). The learning rate is the loop's ``η_r`` (``loop.lr`` and its schedule; the seed
papers use 3e-4 for ResNet-18 and DeiT, 1e-3 for ViT-B LoRA). The loop's ``max_grad_norm`` clips ``g``
before the Adam step. Server: FedAvg, ``x ← x + η_g·Δ̄``.

The released code (J family) builds the same optimizers: ``update_fedavg_adam`` with ``weight_decay=--alpha``
(CLI default 0.01; some README commands pass 10) and ``update_fedavg_adamw`` with wd 0.01, betas 0.9/0.999,
eps 1e-8 (its current parsers lack ``--beta1/--beta2``, so that branch crashes there).
"""

from __future__ import annotations

import torch

from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, LocalUpdateRule, ServerRule
from fedlight.core.scale import Scale
from fedlight.errors import check


class AdamClient(LocalUpdateRule):
    """FedAvg client whose local optimizer is a fresh Adam/AdamW each round.

    Args:
        decoupled: AdamW (decoupled weight decay) instead of Adam (coupled L2).
        weight_decay: wd.
        beta1: β1.
        beta2: β2.
        eps: ε.
    """

    def __init__(self, decoupled: bool, weight_decay: float = 0.01, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8) -> None:
        self.decoupled = decoupled
        self.kwargs = {"weight_decay": weight_decay, "betas": (beta1, beta2), "eps": eps}

    def make_optimizer(self, params, lr, default):
        cls = torch.optim.AdamW if self.decoupled else torch.optim.Adam
        return cls(params, lr=lr, **self.kwargs)  # fresh moments every round


def _check_adam(weight_decay: float, beta1: float, beta2: float, eps: float, server_lr: float) -> None:
    check(weight_decay >= 0, f"`algorithm.weight_decay` must be >= 0, got {weight_decay}")
    check(0 <= beta1 < 1, f"`algorithm.beta1` must be in [0, 1), got {beta1}")
    check(0 <= beta2 < 1, f"`algorithm.beta2` must be in [0, 1), got {beta2}")
    check(eps > 0, f"`algorithm.eps` must be > 0, got {eps}")
    check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")


@register("local_adam", paper="Kingma & Ba, ICLR 2015 (local baseline of Sun et al. 2023; Liu et al., AAAI 2026)",
          backprops=1, comm=(1, 1))
class LocalAdam(Algorithm):
    """Local Adam: a fresh ``torch.optim.Adam`` (coupled L2) on every client each round; FedAvg server.

    The local learning rate is ``loop.lr`` (typically 3e-4); ``loop.optimizer``/``loop.weight_decay`` are
    ignored.

    Args:
        weight_decay: coupled L2 coefficient (``g ← g + wd·y``), ≥ 0.
        beta1: β1, in [0, 1).
        beta2: β2, in [0, 1).
        eps: ε (> 0).
        server_lr: η_g.
    """

    scales = (Scale("loop.lr", paper=3e-4, low=1e-6, high=1e-2),)  # Adam-scale lr: fedlight.config.advice

    def __init__(self, weight_decay: float = 0.01, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 server_lr: float = 1.0) -> None:
        _check_adam(weight_decay, beta1, beta2, eps, server_lr)
        super().__init__(AdamClient(False, weight_decay, beta1, beta2, eps), ServerRule(server_lr))


@register("local_adamw", paper="Loshchilov & Hutter, ICLR 2019 (local baseline of Liu et al., AAAI 2026)",
          backprops=1, comm=(1, 1))
class LocalAdamW(Algorithm):
    """Local AdamW: a fresh ``torch.optim.AdamW`` (decoupled decay) on every client each round; FedAvg server.

    The local learning rate is ``loop.lr`` (typically 3e-4); ``loop.optimizer``/``loop.weight_decay`` are
    ignored.

    Args:
        weight_decay: decoupled decay λ (``y ← y − η·λ·y``), ≥ 0.
        beta1: β1, in [0, 1).
        beta2: β2, in [0, 1).
        eps: ε (> 0).
        server_lr: η_g.
    """

    scales = (Scale("loop.lr", paper=3e-4, low=1e-6, high=1e-2),)  # Adam-scale lr: fedlight.config.advice

    def __init__(self, weight_decay: float = 0.01, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 server_lr: float = 1.0) -> None:
        _check_adam(weight_decay, beta1, beta2, eps, server_lr)
        super().__init__(AdamClient(True, weight_decay, beta1, beta2, eps), ServerRule(server_lr))
