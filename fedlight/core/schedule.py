"""A client rule whose learning rate changes over the local steps of a round (:class:`InRoundLR`): FedSWA's
cyclic decay builds on it, and the loop's ``loop.local_lr_schedule`` wraps any rule in it
(:func:`fedlight.engine.local_schedule.local_schedule`)."""

from __future__ import annotations

from collections.abc import Callable

from fedlight.core.rules import LocalUpdateRule
from fedlight.core.wrap import LocalWrapper


class InRoundLR(LocalWrapper):
    """Runs ``inner`` with a learning rate that changes over the local steps of a round.

    Before local step ``k`` (0-based) the optimizer's lr is set to ``schedule(η_r, k, K)``; ``ctx.lr_sum`` then
    accumulates ``Σ_k η_k`` for rules that divide by it. The round's ``η_r`` (``ctx.lr``) is left as it is.

    Args:
        inner: the client rule whose steps are rescheduled.
        schedule: ``(η_r, k, K) -> η_k``.
    """

    def __init__(self, inner: LocalUpdateRule, schedule: Callable[[float, int, int], float]) -> None:
        super().__init__(inner)
        self.schedule = schedule

    def step(self, model, batch, ctx):
        ctx.set_lr(self.schedule(ctx.lr, ctx.step_index, ctx.num_steps))  # η_k
        return self.inner.step(model, batch, ctx)
