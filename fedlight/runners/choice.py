"""``loop.client_parallelism: auto``: the route that trains the clients, read off a table of measured routes.

:data:`MEASURED` holds, per device type, the seconds per round of every route measured on it (with the card and the
workload); :data:`AUTO` lists the routes ``auto`` may take on that device, fastest measured first, each with the
``loop.compile`` it runs with; ``auto`` takes the first one that the rule, model and task allow (:func:`blocker`)
and that has nothing :attr:`Route.pending`, and says which and why. A route enters :data:`AUTO` only with a
measurement on that device and only when it is exact (the sequential runner's math up to summation order) and falls
back rather than fail (the stacked runner's compile → eager → sequential chain); the sequential runner closes every
list. ``tools/gpu_profile.py --sections anchor,routes`` measures the routes (``tools/gpu_check.sh --routes``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from torch import nn

from fedlight.runners.base import TrainSetup


@dataclass(frozen=True)
class Route:
    """One entry of :data:`AUTO`: a runner, how it runs, and the evidence that ranks it on the device."""

    runner: str
    """``stacked``, ``streams`` or ``sequential``."""
    why: str
    """Said in the run's log when ``auto`` picks it (``{device}``: the device type)."""
    compile: bool | str | None = None
    """``loop.compile`` when ``auto`` picks the route and ``loop.compile`` is ``null``."""
    channels_last: bool = False
    """The stacked runner's channels-last convolutions (:mod:`fedlight.runners.nhwc`)."""
    pending: str | None = None
    """What must still be checked on the device before ``auto`` takes the route (``None``: nothing)."""


MEASURED_ON = ("issue 42's H200 measurement (torch 2.11, bf16, FedAvg ResNet-18 GroupNorm, 10 clients x 50 steps x "
               "batch 50; results/performance.md §6)")
MEASURED: dict[str, dict[str, float]] = {
    "cuda": {"anchor (a)": 0.557, "stacked+graphs": 1.166, "stacked+channels_last": 1.180, "stacked": 1.293,
             "streams+graphs": 2.147, "sequential+compiled": 5.770, "streams+compiled": 5.965, "streams": 7.046},
}
"""Seconds per round of every route measured (:data:`MEASURED_ON`); ``anchor (a)``: one model, the round's images
in ``steps`` steps of ``clients × batch`` (the bound a round is held to). ``streams`` and ``streams+compiled`` lost to
``sequential+compiled`` and are gone (issue 42); ``sequential+compiled`` is not an ``auto`` route (no fallback when
compiling fails)."""

STREAMS_PENDING = ("streams with CUDA graphs keep each client's dropout masks on CPU; on a GPU that is "
                   "tests/loop/test_runner_routes.py::test_streams_keep_dropout_masks_as_sequential[cuda], not run yet")

_CUDA_ROUTES = {
    "stacked+graphs": Route("stacked", "", compile="reduce-overhead"),
    "stacked+channels_last+graphs": Route("stacked", "", compile="reduce-overhead", channels_last=True),
    "stacked+channels_last": Route("stacked", "", compile=True, channels_last=True),
    "stacked": Route("stacked", "", compile=True),
    "streams+graphs": Route("streams", "", compile="reduce-overhead", pending=STREAMS_PENDING),
}


def _ranked(device: str, routes: dict[str, Route]) -> tuple[Route, ...]:
    """``routes`` that :data:`MEASURED` times on ``device``, fastest first, each saying its time; then sequential."""
    times = MEASURED[device]
    names = sorted((n for n in routes if n in times), key=times.__getitem__)
    out = []
    for n in names:
        r = routes[n]
        why = (f"CUDA device; {'rule and model run stacked' if r.runner == 'stacked' else 'streams'}: {n}, "
               f"{times[n]:.3f} s/round = {times[n] / times['anchor (a)']:.2f} x anchor (a) in "
               f"{MEASURED_ON.split(' (')[0]} (sequential compiled {times['sequential+compiled']:.2f} s)")
        out.append(Route(r.runner, why, r.compile, r.channels_last, r.pending))
    return (*out, Route("sequential", "CUDA device"))


AUTO: dict[str, tuple[Route, ...]] = {"cuda": _ranked("cuda", _CUDA_ROUTES)}
"""Routes per device type, fastest measured first; a device type not listed gets :data:`OTHER`."""

OTHER: tuple[Route, ...] = (
    Route("sequential", "{device} device (stacked clients pay off on CUDA; force with vmap)"),)


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
    route, why = pick_route(setup, table)
    return route.runner, why


def pick_route(setup: TrainSetup, table: dict[str, tuple[Route, ...]] | None = None) -> tuple[Route, str]:
    """:func:`pick`, with the whole :class:`Route` (its ``compile`` and layout)."""
    device = setup.device.type
    routes = (AUTO if table is None else table).get(device, OTHER)
    first_block = None
    for route in routes:
        why = route.pending or blocker(route.runner, setup)
        if why is None:
            return route, f"auto: {first_block or route.why.format(device=device)}"
        first_block = first_block or (None if route.pending else why)
    return Route("sequential", ""), f"auto: {first_block}"


def _drops(m: nn.Module) -> bool:
    """Dropout with p > 0, or stochastic depth (timm's ``DropPath`` with ``drop_prob > 0``, as in Swin/ViT)."""
    if isinstance(m, nn.modules.dropout._DropoutNd):
        return m.p > 0
    p = getattr(m, "drop_prob", None)
    return isinstance(p, numbers.Real) and p > 0
