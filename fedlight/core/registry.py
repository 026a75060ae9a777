"""Register once, list everywhere: the registry feeds ``fedlight ls``, the contract tests and the docs table.

fedlight's own algorithms register when ``fedlight`` is imported (its ``__init__`` imports :mod:`fedlight.algorithms`),
so the registry never imports the rules that use it. Rules of other packages are found two ways:

* by class path, ``my_module:MyRule`` or ``my_module.MyRule`` (:func:`algorithm_class`): a module on ``sys.path``,
  else in the working directory (as ``python -m`` would find it);
* by registry name, through the ``fedlight.algorithms`` entry-point group of installed packages: a package that
  declares ``my_rule = "my_lab.rules"`` there has ``my_lab.rules`` imported (its ``@register("my_rule")`` runs) the
  first time ``my_rule`` is asked for and is not registered yet.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import os
import sys
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


def _lookup(name: str) -> AlgorithmSpec | None:
    if name in _REGISTRY:
        return _REGISTRY[name]
    folded = {_fold(s.cls.__name__): s for s in _REGISTRY.values()} | {_fold(n): s for n, s in _REGISTRY.items()}
    return folded.get(_fold(name))


ENTRY_POINTS = "fedlight.algorithms"
"""The entry-point group through which installed packages offer rules (name → the module that registers it)."""


def _entry_points() -> list:
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINTS))


def load_plugins(name: str | None = None) -> None:
    """Import the modules that installed packages declare under the ``fedlight.algorithms`` entry points (only those
    declared as ``name``, any letter case, when given), so their ``@register`` runs. A module that fails to import
    is a :class:`ConfigError` naming the package."""
    for ep in _entry_points():
        if name is not None and _fold(ep.name) != _fold(name):
            continue
        try:
            ep.load()
        except Exception as e:  # the plugin's own error, named with its package
            dist = getattr(getattr(ep, "dist", None), "name", "?")
            raise ConfigError(f"algorithm {ep.name!r} (entry point of package {dist}): importing {ep.value} failed: "
                              f"{type(e).__name__}: {e}") from None


def get_algorithm(name: str) -> AlgorithmSpec:
    """The algorithm registered as ``name``; its class name and any letter case work too (``fedadamw``,
    ``FedAdamW``, ``FEDADAMW``, ``local-adam``). A name not registered yet is looked up among installed packages'
    ``fedlight.algorithms`` entry points. An unknown name is a :class:`ConfigError` naming the closest one and the
    class-path form."""
    spec = _lookup(name)
    if spec is None and any(_fold(ep.name) == _fold(name) for ep in _entry_points()):
        load_plugins(name)
        spec = _lookup(name)
        if spec is None:
            raise ConfigError(f"algorithm {name!r}: its package's `{ENTRY_POINTS}` entry point imported, but nothing "
                              f"registered that name; decorate its class with `@fedlight.register({name!r}, ...)`")
    if spec is None:
        known = sorted({*_REGISTRY, *(ep.name for ep in _entry_points())})
        raise ConfigError(f"unknown algorithm {name!r}{closest(name, known)} (list them with `fedlight ls "
                          "algorithms`; a rule of your own by its class path: `my_module:MyRule`, a module in the "
                          "working directory or on PYTHONPATH)")
    return spec


def import_module(module: str):
    """``import module``; one not on ``sys.path`` is looked for in the working directory too, which then stays at
    the end of ``sys.path`` (where it shadows nothing), so the module's own later imports find their siblings."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0] or os.getcwd() in sys.path or "" in sys.path:
            raise
    sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        sys.path.remove(os.getcwd())
        raise


def algorithm_class(value: str) -> type:
    """The ``Algorithm`` class ``value`` names: a registry name (:func:`get_algorithm`), or a class path
    ``module:Class`` / ``module.Class`` (``module:name`` also takes a name the module registers), the module found on
    ``sys.path`` or in the working directory. What does not resolve is a :class:`ConfigError` saying why."""
    if ":" not in value and "." not in value:
        return get_algorithm(value).cls
    module, _, attr = value.partition(":") if ":" in value else value.rpartition(".")
    try:
        mod = import_module(module)
    except ImportError as e:
        raise ConfigError(f"algorithm {value!r}: cannot import {module!r} ({type(e).__name__}: {e}); a rule of your "
                          "own is `my_module:MyRule` with my_module.py in the working directory or on PYTHONPATH, "
                          "a registered one its name (`fedlight ls algorithms`)") from None
    cls = getattr(mod, attr, None)
    if cls is None and _lookup(attr) is not None and _lookup(attr).cls.__module__ == mod.__name__:
        cls = _lookup(attr).cls  # module:registered_name
    if not isinstance(cls, type):
        names = [n for n, v in vars(mod).items() if isinstance(v, type) and not n.startswith("_")]
        like = closest(attr, names, module + (":" if ":" in value else "."))
        raise ConfigError(f"algorithm {value!r}: module {module!r} has no class {attr!r}{like}")
    return cls


def class_path_of(cls: type) -> str:
    """``cls`` as the class path a recipe records: ``fedlight.algorithms.FedSAM`` for fedlight's own rules, else
    ``module.Class``."""
    if cls.__module__.startswith("fedlight.algorithms."):
        return f"fedlight.algorithms.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def create(name: str, **kwargs):
    """Instantiate an algorithm by registry name or class path (:func:`algorithm_class`)."""
    return algorithm_class(name)(**kwargs)
