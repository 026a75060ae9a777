"""Every algorithm fedlight ships, one file per paper. Importing this package registers them all.

Each module registers its ``Algorithm`` subclasses with ``@register``; they are re-exported here so
recipes can say ``class_path: fedlight.algorithms.FedNSAM``.
"""

import importlib
import pkgutil

from fedlight.core.registry import _REGISTRY

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_m}")

globals().update({spec.cls.__name__: spec.cls for spec in _REGISTRY.values()})
__all__ = sorted(spec.cls.__name__ for spec in _REGISTRY.values())
