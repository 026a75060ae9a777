"""fedlight: Lightning Fabric training recipes for federated optimization research.

The package is grouped by role: ``fedlight.core`` holds the rule contract (rules, tensor-dict helpers, registry,
the precision forward), ``fedlight.engine`` runs it (the round loop, the fit driver, the run state, the client-state
store, aggregation, sampling), ``fedlight.config`` configures it (``fit``, loop settings, the CLI, recipes); the
replaceable parts live in ``algorithms``, ``data``, ``models``, ``tasks`` and ``runners``, run files in ``run`` and
the research tools in ``lab``. The paths before this grouping (``fedlight.rules``, ``fedlight.loop``, ...) still
import the same modules.

The package's face is the rule contract (``Algorithm``, ``LocalUpdateRule``, ``ServerRule`` ...), the registry and
:func:`fit`. Importing ``fedlight`` (or ``fedlight.rules``, or one rule such as ``fedlight.algorithms.fedsam``) loads
only the contract: ``fit`` and with it the loop, the data modules, the models and Lightning are imported on first
use, so a rule lifted into a custom Fabric script pays for nothing else.
"""

__version__ = "0.1.0"

from fedlight import _moved  # noqa: E402

_moved.install()  # fedlight.rules, fedlight.loop, fedlight.cli ...: the paths before core/ engine/ config/

import fedlight.algorithms  # noqa: E402,F401 - fedlight's own rules register here (fedlight.create("fedsam"))
from fedlight.core.params import Params  # noqa: E402
from fedlight.core.registry import create, get_algorithm, list_algorithms, register  # noqa: E402
from fedlight.core.rules import (  # noqa: E402
    Algorithm,
    Broadcast,
    ClientResult,
    LocalContext,
    LocalUpdateRule,
    RoundInfo,
    ServerRule,
    cross_entropy,
)
from fedlight.engine.sampling import sample_clients  # noqa: E402

__all__ = [
    "Algorithm", "Broadcast", "ClientResult", "LocalContext", "LocalUpdateRule", "Params", "RoundInfo",
    "ServerRule", "create", "cross_entropy", "fit", "get_algorithm", "list_algorithms", "register",
    "sample_clients",
]

_LAZY = {"fit": "fedlight.config.api"}  # name -> module, imported on first access (PEP 562)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fedlight' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
