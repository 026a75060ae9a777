"""fedlight: Lightning Fabric training recipes for federated optimization research.

The package's face is the rule contract (``Algorithm``, ``LocalUpdateRule``, ``ServerRule`` ...), the registry and
:func:`fit`. Importing ``fedlight`` loads nothing until a name is used; ``fedlight.rules`` (or one rule such as
``fedlight.algorithms.fedsam``) loads only the contract: ``fit`` and with it the loop, the data modules, the models
and Lightning are imported on first use, so a rule lifted into a custom Fabric script pays for nothing else.
"""

__version__ = "0.1.0"

__all__ = [
    "Algorithm", "Broadcast", "ClientResult", "LocalContext", "LocalUpdateRule", "Params", "RoundInfo",
    "ServerRule", "create", "cross_entropy", "fit", "get_algorithm", "list_algorithms", "register",
    "sample_clients",
]

_LAZY = {"fit": "fedlight.api", "Params": "fedlight.params", "sample_clients": "fedlight.sampling",
         **dict.fromkeys(("create", "get_algorithm", "list_algorithms", "register"), "fedlight.registry"),
         **dict.fromkeys(("Algorithm", "Broadcast", "ClientResult", "LocalContext", "LocalUpdateRule", "RoundInfo",
                          "ServerRule", "cross_entropy"), "fedlight.rules")}
"""name -> module, imported on first access (PEP 562): ``import fedlight`` itself loads nothing (the command line
catches stop signals before torch is imported)."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fedlight' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
