"""Class-path specs (``{"class_path": ..., "init_args": {...}}``): build an object from one, describe one.

A Python-API run records its model, data and algorithm as specs in ``config.yaml`` so ``landscape``, ``sharpness``
and ``--resume`` can rebuild them. :func:`describe` recovers constructor arguments from same-named attributes
(``x`` or ``_x``); arguments an object does not keep cannot be recovered: pass the model to :func:`fedlight.fit` as
a spec (it is then built after seeding, exactly as the CLI builds it) to record it completely.
"""

from __future__ import annotations

import functools
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


def remember_init_args(cls: type) -> None:
    """Wrap ``cls.__init__`` so an instance keeps the arguments of its outermost constructor call in
    ``_init_args`` (what :func:`describe` records). Call it from ``__init_subclass__`` of a base class."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_remembers", False):
        return
    sig = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "_init_args" not in self.__dict__:
            try:
                bound = sig.bind(self, *args, **kwargs)
            except TypeError:
                bound = None  # the call itself fails below, with Python's message
            if bound is not None:
                self.__dict__["_init_args"] = _flat_arguments(sig, bound)
        init(self, *args, **kwargs)

    __init__._remembers = True
    cls.__init__ = __init__


def _flat_arguments(sig: inspect.Signature, bound: inspect.BoundArguments) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind != inspect.Parameter.VAR_POSITIONAL:
            out[name] = value
    return out


def describe(obj: Any) -> dict[str, Any]:
    """``{"class_path", "init_args"}`` of ``obj``: the arguments it was built with when its class remembers them
    (:func:`remember_init_args`), else the constructor arguments it keeps as same-named attributes (or, for a
    LightningModule, in ``hparams``)."""
    cls = type(obj)
    out: dict[str, Any] = {"class_path": f"{cls.__module__}.{cls.__qualname__}"}
    given = getattr(obj, "__dict__", {}).get("_init_args")
    if given is not None:
        args = {k: v for k, v in ((k, _plain(v)) for k, v in given.items()) if v is not _NO}
        return {**out, "init_args": args} if args else out
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return out
    attrs = vars(obj) if hasattr(obj, "__dict__") else {}
    saved = getattr(obj, "hparams", None)  # a LightningModule's save_hyperparameters()
    if isinstance(saved, dict):
        attrs = {**attrs, **saved}
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
