"""fedlight: Lightning Fabric training recipes for federated optimization research.

The package is grouped by role: ``fedlight.core`` holds the rule contract (rules, tensor-dict helpers, registry,
the precision forward), ``fedlight.engine`` runs it (the round loop, the fit driver, the run state, the client-state
store, aggregation, sampling), ``fedlight.config`` configures it (``fit``, loop settings, the CLI, recipes); the
replaceable parts live in ``algorithms``, ``data``, ``models``, ``tasks`` and ``runners``, run files in ``run`` and
the research tools in ``lab``. ``fedlight.rules`` and ``fedlight.params`` are short re-export files of
``fedlight.core.rules`` and ``fedlight.core.params``; the other paths before this grouping (``fedlight.loop``,
``fedlight.cli`` ...) still import the same modules, with a DeprecationWarning.

The package's face is the rule contract (``Algorithm``, ``LocalUpdateRule``, ``ServerRule`` ...), the registry and
:func:`fit`. Importing ``fedlight`` loads nothing until a name is used (the command line catches stop signals before
torch is imported); ``fedlight.core.rules`` (or one rule such as ``fedlight.algorithms.fedsam``) loads only the
contract:
``fit`` and with it the loop, the data modules, the models and Lightning are imported on first use, so a rule lifted
into a custom Fabric script pays for nothing else. The registry's names (``create``, ``list_algorithms`` ...)
import ``fedlight.algorithms`` first, so fedlight's own rules are registered.
"""

__version__ = "0.1.0"

from fedlight import _moved  # noqa: E402 - the standard library only

_moved.install()  # retired paths (fedlight.loop, fedlight.cli ...): the module of their new home, with a warning

__all__ = [
    "Algorithm", "Broadcast", "ClientResult", "ClientTrainer", "LocalContext", "LocalUpdateRule", "Params",
    "RoundInfo", "ServerRule", "create", "cross_entropy", "fit", "get_algorithm", "list_algorithms", "register",
    "sample_clients",
]

_REGISTRY_NAMES = ("create", "get_algorithm", "list_algorithms", "register")
_LAZY = {"fit": "fedlight.config.api", "ClientTrainer": "fedlight.fabric", "Params": "fedlight.core.params",
         "sample_clients": "fedlight.core.sampling",
         **dict.fromkeys(_REGISTRY_NAMES, "fedlight.core.registry"),
         **dict.fromkeys(("Algorithm", "Broadcast", "ClientResult", "LocalContext", "LocalUpdateRule", "RoundInfo",
                          "ServerRule", "cross_entropy"), "fedlight.core.rules")}
"""name -> module, imported on first access (PEP 562)."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        if name in _REGISTRY_NAMES:
            importlib.import_module("fedlight.algorithms")  # fedlight's own rules register on import
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fedlight' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
