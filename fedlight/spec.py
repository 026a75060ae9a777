"""Class-path specs (``{"class_path": ..., "init_args": {...}}``): build an object from one, describe one.

A Python-API run records its model, data and algorithm as specs in ``config.yaml`` so ``landscape``, ``sharpness``
and ``--resume`` can rebuild them. :func:`describe` recovers constructor arguments from same-named attributes
(``x`` or ``_x``); arguments an object does not keep cannot be recovered: pass the model to :func:`fedlight.fit` as
a spec (it is then built after seeding, exactly as the CLI builds it) to record it completely.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

_NO = object()


def build(spec: dict[str, Any] | str) -> Any:
    """Instantiate a spec (nested specs in ``init_args`` too), or a bare class path with no arguments."""
    from fedlight.errors import ConfigError

    if isinstance(spec, str):
        spec = {"class_path": spec}
    path = spec.get("class_path", "")
    module, _, name = str(path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"`model`: {path!r} is not an importable class path (e.g. fedlight.models.MLP; list "
                          "them with `fedlight ls models`)") from None
    args = {k: build(v) if isinstance(v, dict) and "class_path" in v else v
            for k, v in (spec.get("init_args") or {}).items()}
    return cls(**args)


def describe(obj: Any) -> dict[str, Any]:
    """``{"class_path", "init_args"}`` of ``obj`` with the constructor arguments it keeps as attributes."""
    cls = type(obj)
    out: dict[str, Any] = {"class_path": f"{cls.__module__}.{cls.__qualname__}"}
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return out
    attrs = vars(obj) if hasattr(obj, "__dict__") else {}
    args = {}
    for name, p in params.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        for attr in (name, f"_{name}"):
            if attr in attrs:
                v = _plain(attrs[attr])
                if v is not _NO:
                    args[name] = v
                break
    if args:
        out["init_args"] = args
    return out


def _plain(v: Any, depth: int = 0) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if depth > 3:
        return _NO
    if isinstance(v, (list, tuple)):
        items = [_plain(x, depth + 1) for x in v]
        return _NO if any(x is _NO for x in items) else items
    if isinstance(v, dict):
        items = {str(k): _plain(x, depth + 1) for k, x in v.items()}
        return _NO if any(x is _NO for x in items.values()) else items
    if type(v).__module__.startswith(("torch", "numpy", "builtins")):
        return _NO
    return describe(v)
