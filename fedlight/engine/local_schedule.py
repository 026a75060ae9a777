"""``loop.local_lr_schedule``: the client rule the loop runs, with an in-round lr schedule when asked."""

from __future__ import annotations

from collections.abc import Callable

from fedlight.core.rules import LocalUpdateRule
from fedlight.core.schedule import InRoundLR
from fedlight.errors import check


def local_schedule(local: LocalUpdateRule, schedule: str, lr_of_step: Callable[[float, int, int], float]
                   ) -> LocalUpdateRule:
    """The client rule the loop runs under ``loop.local_lr_schedule``: ``local`` itself when ``schedule`` is
    ``constant``, else ``local`` with the lr of local step k set to ``lr_of_step(η_r, k, K)`` (:class:`InRoundLR`).
    A rule that already schedules its own in-round lr (FedSWA's linear decay) is refused."""
    if schedule == "constant":
        return local
    check(not isinstance(local, InRoundLR), f"`loop.local_lr_schedule: {schedule}`: this rule already sets its own "
          "lr inside the round (FedSWA/FedMoSWA's ρ); keep `loop.local_lr_schedule: constant` for it")
    return InRoundLR(local, lr_of_step)
