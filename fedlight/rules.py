"""The rule contract under its short path: ``from fedlight.rules import LocalUpdateRule`` is
``from fedlight.core.rules import LocalUpdateRule``. The definitions live in :mod:`fedlight.core.rules`."""

from fedlight.core.rules import (
    Algorithm,
    Broadcast,
    ClientResult,
    LocalContext,
    LocalUpdateRule,
    RoundInfo,
    ServerRule,
    cross_entropy,
)

__all__ = ["Algorithm", "Broadcast", "ClientResult", "LocalContext", "LocalUpdateRule", "RoundInfo", "ServerRule",
           "cross_entropy"]
