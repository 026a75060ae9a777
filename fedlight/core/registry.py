"""Register once, list everywhere: the registry feeds ``fedlight ls``, the contract tests and the docs table.

fedlight's own algorithms register when ``fedlight`` is imported (its ``__init__`` imports :mod:`fedlight.algorithms`),
so the registry never imports the rules that use it."""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass

from fedlight.errors import ConfigError


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    cls: type
    paper: str
    backprops: int
    """Backward passes per local step."""
    comm: tuple[float, float]
    """Communication per client per round in model-sized vectors: (down, up)."""
    stateful_clients: bool = False
    """Whether each client keeps persistent state (c_i, h_i, momenta) between rounds."""


_REGISTRY: dict[str, AlgorithmSpec] = {}


def register(name: str, *, paper: str, backprops: int = 1, comm: tuple[float, float] = (1, 1),
             stateful_clients: bool = False):
    """Class decorator: register an :class:`~fedlight.core.rules.Algorithm` subclass under ``name``."""

    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"algorithm name {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = AlgorithmSpec(name, cls, paper, backprops, comm, stateful_clients)
        return cls

    return deco


def list_algorithms(pattern: str = "*") -> list[str]:
    return sorted(n for n in _REGISTRY if fnmatch.fnmatch(n, pattern))


def _fold(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _typos(a: str, b: str) -> int:
    """Edits between ``a`` and ``b``: insertions, deletions, substitutions, adjacent swaps (fedsma → fedsam: 1)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def closest(word: str, candidates, what: str = "") -> str:
    """``"; did you mean 'rho'?"`` (the nearest of ``candidates`` to ``word``, any letter case), or ``""``."""
    scored = sorted((_typos(_fold(word), _fold(c)), -difflib.SequenceMatcher(None, word, c).ratio(), c)
                    for c in candidates)
    if not scored or scored[0][0] > max(2, len(_fold(word)) // 3):
        return ""
    return f"; did you mean {what + scored[0][2]!r}?"


def get_algorithm(name: str) -> AlgorithmSpec:
    """The algorithm registered as ``name``; its class name and any letter case work too (``fedadamw``,
    ``FedAdamW``, ``FEDADAMW``, ``local-adam``). An unknown name is a :class:`ConfigError` naming the closest one."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    folded = {_fold(s.cls.__name__): s for s in _REGISTRY.values()} | {_fold(n): s for n, s in _REGISTRY.items()}
    if _fold(name) in folded:
        return folded[_fold(name)]
    raise ConfigError(f"unknown algorithm {name!r}{closest(name, sorted(_REGISTRY))} (list them with "
                      "`fedlight ls algorithms`)")


def create(name: str, **kwargs):
    """Instantiate a registered algorithm by name."""
    return get_algorithm(name).cls(**kwargs)
