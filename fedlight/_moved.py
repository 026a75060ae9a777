"""Retired import paths: modules that lived at ``fedlight.<name>`` before the package was grouped into ``core/``,
``engine/`` and ``config/``.

``import fedlight.loop`` (or ``fedlight.cli``, ``fedlight.args`` ...) keeps working for a user's old script: it gives
the very module object of the new home (``fedlight.engine.loop``), so ``monkeypatch`` and ``isinstance`` see one
module, with a :class:`DeprecationWarning` that names the path to use. No file exists at a retired path and nothing
inside fedlight imports one (``tests/test_imports.py`` fails on any). The two short paths users are taught,
``fedlight.rules`` and ``fedlight.params``, are real re-export files, not retired names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "registry": "core.registry", "precision": "core.precision", "sampling": "core.sampling", "spec": "core.spec",
    "args": "core.loop_config",
    "loop": "engine.loop", "fitting": "engine.driver", "loop_state": "engine.loop_state",
    "state": "engine.client_store", "aggregate": "engine.aggregate",
    "api": "config.api", "flags": "config.flags", "advice": "config.advice", "catalog": "config.catalog",
    "cli": "config.cli",
}
"""Retired name under ``fedlight.`` → its module under ``fedlight.``."""


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``fedlight.<retired>`` and answers with the module ``fedlight.<new>`` (imported on first use)."""

    def find_spec(self, name, path=None, target=None):
        old = name.removeprefix("fedlight.")
        if not name.startswith("fedlight.") or old not in MOVED:
            return None
        origin = importlib.util.find_spec(f"fedlight.{MOVED[old]}").origin  # `python -m` puts it in argv[0]
        return importlib.util.spec_from_loader(name, self, origin=origin)

    def create_module(self, spec):
        new = f"fedlight.{MOVED[spec.name.removeprefix('fedlight.')]}"
        warnings.warn(f"`{spec.name}` is a retired import path; import `{new}` instead", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """The module is the new one, already executed."""

    def get_code(self, name):
        """For ``python -m fedlight.<retired>``: the new module's code, run as ``__main__``."""
        new = f"fedlight.{MOVED[name.removeprefix('fedlight.')]}"
        return importlib.util.find_spec(new).loader.get_code(new)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before any other finder (an editable install of an older checkout)
