"""FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized Data").

Client: K local SGD steps with ``d = g``. Server: ``x ← x + η_g·Δ̄``. Both halves are the contract's
defaults, so this file only names them.
"""

from __future__ import annotations

from fedlight.core.registry import register
from fedlight.core.rules import Algorithm, LocalUpdateRule, ServerRule
from fedlight.errors import check


@register("fedavg", paper="McMahan et al., AISTATS 2017", backprops=1, comm=(1, 1))
class FedAvg(Algorithm):
    """FedAvg.

    Args:
        server_lr: η_g, the global learning rate (1.0 = plain averaging).
    """

    def __init__(self, server_lr: float = 1.0) -> None:
        check(server_lr > 0, f"`algorithm.server_lr` must be > 0, got {server_lr}")
        super().__init__(LocalUpdateRule(), ServerRule(lr=server_lr))
