"""A setting whose scale an algorithm's paper fixes (:class:`Scale`), declared on the algorithm class; the
checks that read these declarations live in :mod:`fedlight.config.advice`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Scale:
    """A setting's paper value and the range in which the rule trains at all."""

    key: str
    """The recipe key: ``loop.lr`` or ``algorithm.<init argument>`` (e.g. ``algorithm.server_lr``)."""
    paper: float
    """The paper's value (what fedlight gives the setting when the user did not choose it)."""
    low: float
    high: float
    attr: str | None = None
    """Where an ``algorithm.*`` value lives on the instance (e.g. ``server.lr``); ``loop.*`` values need none."""


class ScaleWarning(UserWarning):
    """A setting is outside the range in which its algorithm trains (see :class:`Scale`)."""


def scales_of(algorithm: Any) -> tuple[Scale, ...]:
    """The :class:`Scale` declarations of an algorithm class or instance (none for SGD-type rules)."""
    cls = algorithm if isinstance(algorithm, type) else type(algorithm)
    return tuple(getattr(cls, "scales", ()))
