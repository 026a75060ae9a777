"""Both Lightning packages: ``lightning.pytorch`` and the standalone ``pytorch_lightning``.

A module or data module written against either is recognised the same way; neither package is required by the
other (whichever is installed is used). A plain ``nn.Module`` stays a plain module.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Any

PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _classes(name: str) -> list[type]:
    """``name`` (e.g. ``LightningModule``) from each Lightning package already imported: an object can only derive
    from a class whose module was imported, so asking about a plain module imports no Lightning package (the
    standalone ``pytorch_lightning`` alone took ~260 modules and seconds of every run's start-up)."""
    out = []
    for package in PACKAGES:
        if (module := sys.modules.get(package)) is not None and hasattr(module, name):
            out.append(getattr(module, name))
    return out


def lightning_base(obj: Any, name: str = "LightningModule") -> type | None:
    """The ``LightningModule`` (or ``name``) class of the package ``obj``'s class derives from, else ``None``."""
    for cls in _classes(name):
        if isinstance(obj, cls):
            return cls
    return None


def is_lightning_module(model: Any) -> bool:
    return lightning_base(model) is not None


def is_lightning_datamodule(data: Any) -> bool:
    return lightning_base(data, "LightningDataModule") is not None


def overrides(obj: Any, method: str) -> bool:
    """Whether ``obj``'s class defines ``method`` itself (not the Lightning default)."""
    base = lightning_base(obj) or lightning_base(obj, "LightningDataModule")
    return base is not None and getattr(type(obj), method, None) is not getattr(base, method, None)


def uncompiled(model: Any) -> Any:
    """``torch.compile(module)`` of a LightningModule (the Lightning docs' pattern): the module itself, with one note,
    so that its own ``configure_optimizers``, hooks and ``self.log`` are used (the compiled wrapper hides them); any
    other model unchanged."""
    inner = getattr(model, "_orig_mod", None)
    if inner is None or not is_lightning_module(inner) or is_lightning_module(model):
        return model
    note(None, f"torch.compile({type(inner).__name__}) is trained as the module itself, with its own "
               "configure_optimizers, hooks and self.log (the compiled wrapper hides them); `--loop.compile true` "
               "compiles the client computation, or compile inside the module (e.g. in configure_model)")
    return inner


def misconfiguration_errors() -> tuple[type, ...]:
    out = []
    for package in filter(sys.modules.__contains__, PACKAGES):  # an exception is raised by a package imported
        try:
            out.append(importlib.import_module(f"{package}.utilities.exceptions").MisconfigurationException)
        except (ImportError, AttributeError):
            continue
    return tuple(out)


def module_name(model: Any) -> str:
    """The user's LightningModule class name (under fedlight's wrappers)."""
    return type(getattr(model, "_fedlight_module", model)).__name__


def note(fabric: Any, message: str) -> None:
    """One ``fedlight: note:`` line from rank 0."""
    if fabric is not None:
        fabric.print(f"fedlight: note: {message}")
    else:
        print(f"fedlight: note: {message}", file=sys.stderr)


def takes_index(step: Any) -> bool:
    """Whether a step method takes ``batch_idx`` after the batch (Lightning passes it only then)."""
    return _takes_index(getattr(step, "__func__", step))


@functools.lru_cache(maxsize=64)
def _takes_index(fn: Any) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_POSITIONAL or p.name == "batch_idx" for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= (3 if hasattr(fn, "__code__") and positional and positional[0].name == "self" else 2)
