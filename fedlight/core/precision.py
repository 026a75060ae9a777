"""The one forward pass under a Fabric precision plugin (training loss, probe, evaluation, memory sizing)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def is_plain(precision: Any) -> bool:
    """Lightning's base ``Precision`` (``32-true``): its forward context, input conversion, backward and optimizer
    step are plain PyTorch, so the per-step wrappers (tens of µs, every step) can be skipped."""
    cls = type(precision)
    return cls.__name__ == "Precision" and cls.__module__ == "lightning.fabric.plugins.precision.precision"


def plugin(fabric: Any) -> Any:
    """``fabric``'s precision plugin; ``None`` for no Fabric (plain fp32 PyTorch) or a plain one."""
    precision = None if fabric is None else fabric.strategy.precision
    return None if precision is None or is_plain(precision) else precision


def forward(fabric: Any, fn: Callable, model: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(model, *args, **kwargs)`` under ``fabric``'s precision plugin: the inputs converted (e.g. to float64
    for ``64-true``), the call inside the plugin's forward context (autocast for the mixed precisions)."""
    precision = plugin(fabric)
    if precision is None:
        return fn(model, *args, **kwargs)
    args, kwargs = precision.convert_input((args, kwargs))
    with precision.forward_context():
        return fn(model, *args, **kwargs)
