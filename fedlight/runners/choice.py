"""``loop.client_parallelism: auto``: the route that trains the clients, read off a table of measured routes.

:data:`AUTO` lists, per device type, the routes in the order ``auto`` tries them, each with the measurement that
puts it there; ``auto`` takes the first one the rule, model and task allow (:func:`blocker`) and says which and
why. A route enters the table only with a measurement on that device: the routes prepared without one
(:data:`UNRANKED`) are reached by naming them (``loop.client_parallelism: streams``; ``loop.channels_last: true``
for the channels-last stacked route) until a GPU session measures them (``tools/gpu_profile.py --sections routes``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from torch import nn

from fedlight.runners.base import TrainSetup


@dataclass(frozen=True)
class Route:
    """One entry of :data:`AUTO`: a runner and the evidence that ranks it on the device."""

    runner: str
    """``stacked``, ``streams`` or ``sequential``."""
    why: str
    """Said in the run's log when ``auto`` picks it (``{device}``: the device type)."""


AUTO: dict[str, tuple[Route, ...]] = {
    "cuda": (Route("stacked", "CUDA device; rule and model run stacked (ResNet-18 round on an H100: 1.33 s compiled "
                              "stacked, 6.26 s sequential; results/performance.md §6)"),
             Route("sequential", "CUDA device")),
}
"""Routes per device type, fastest measured first; a device type not listed gets :data:`OTHER`."""

OTHER: tuple[Route, ...] = (
    Route("sequential", "{device} device (stacked clients pay off on CUDA; force with vmap)"),)

UNRANKED = {
    "streams": "clients on CUDA streams, one model copy each (no grouped convolution): exact on CPU, not measured "
               "on a GPU yet",
    "stacked, channels-last": "the stacked route with channels-last grouped convolutions: exact on CPU, not "
                              "measured on a GPU yet",
}
"""Prepared routes that no measurement ranks yet (``tools/gpu_profile.py --sections routes`` measures them)."""


def blocker(runner: str, setup: TrainSetup) -> str | None:
    """Why ``runner`` cannot train this setup exactly, or ``None``."""
    if runner != "stacked":  # streams and sequential run every rule, model and task as the sequential runner does
        return None
    if setup.local.stacked_unsupported is not None:
        return f"the rule cannot run stacked ({setup.local.stacked_unsupported})"
    if any(_drops(m) for m in setup.model.modules()):
        return "the model has dropout (stacked clients draw different masks than sequential ones)"
    return getattr(setup.task, "stacked_note", None)


def pick(setup: TrainSetup, table: dict[str, tuple[Route, ...]] | None = None) -> tuple[str, str]:
    """The first route of ``table`` (default :data:`AUTO`) for the setup's device that nothing blocks, and the
    reason: the route's own line, or the first blocker met on the way to it."""
    device = setup.device.type
    routes = (AUTO if table is None else table).get(device, OTHER)
    first_block = None
    for route in routes:
        why = blocker(route.runner, setup)
        if why is None:
            return route.runner, f"auto: {first_block or route.why.format(device=device)}"
        first_block = first_block or why
    return "sequential", f"auto: {first_block}"


def _drops(m: nn.Module) -> bool:
    """Dropout with p > 0, or stochastic depth (timm's ``DropPath`` with ``drop_prob > 0``, as in Swin/ViT)."""
    if isinstance(m, nn.modules.dropout._DropoutNd):
        return m.p > 0
    p = getattr(m, "drop_prob", None)
    return isinstance(p, numbers.Real) and p > 0
