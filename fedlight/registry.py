"""Register once, list everywhere: the registry feeds ``fedlight ls``, the contract tests and the docs table."""

from __future__ import annotations

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
    """Class decorator: register an :class:`~fedlight.rules.Algorithm` subclass under ``name``."""

    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"algorithm name {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = AlgorithmSpec(name, cls, paper, backprops, comm, stateful_clients)
        from fedlight.spec import remember_init_args

        remember_init_args(cls)  # a Python-API run's config.yaml records the hyperparameters it was built with
        return cls

    return deco


def _load() -> None:
    import fedlight.algorithms  # noqa: F401  (registers every algorithm)


def list_algorithms(pattern: str = "*") -> list[str]:
    _load()
    return sorted(n for n in _REGISTRY if fnmatch.fnmatch(n, pattern))


def get_algorithm(name: str) -> AlgorithmSpec:
    _load()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown algorithm {name!r}; valid names: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def create(name: str, **kwargs):
    """Instantiate a registered algorithm by name."""
    return get_algorithm(name).cls(**kwargs)
