"""The import paths of modules before the package was grouped into ``core/``, ``engine/`` and ``config/``.

``import fedlight.rules`` (or ``fedlight.loop``, ``fedlight.cli`` ...) keeps working and gives the very module object
of its new home (``fedlight.core.rules``), so ``monkeypatch`` and ``isinstance`` see one module, and
``python -m fedlight.cli`` still runs the command. No file is left at an old path (other branches' edits of a moved
file follow it through git's rename detection).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "rules": "core.rules", "params": "core.params", "registry": "core.registry", "precision": "core.precision",
    "loop": "engine.loop", "fitting": "engine.driver", "loop_state": "engine.state", "state": "engine.client_store",
    "aggregate": "engine.aggregate", "sampling": "engine.sampling",
    "api": "config.api", "args": "config.args", "flags": "config.flags", "advice": "config.advice",
    "spec": "config.spec", "catalog": "config.catalog", "cli": "config.cli",
}
"""Old name under ``fedlight.`` → new name under ``fedlight.``."""


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``fedlight.<old>`` and answers with the module ``fedlight.<new>`` (imported on first use)."""

    def find_spec(self, name, path=None, target=None):
        old = name.removeprefix("fedlight.")
        if not name.startswith("fedlight.") or old not in MOVED:
            return None
        origin = importlib.util.find_spec(f"fedlight.{MOVED[old]}").origin  # `python -m` puts it in argv[0]
        return importlib.util.spec_from_loader(name, self, origin=origin)

    def create_module(self, spec):
        return importlib.import_module(f"fedlight.{MOVED[spec.name.removeprefix('fedlight.')]}")

    def exec_module(self, module) -> None:
        """The module is the new one, already executed."""

    def get_code(self, name):
        """For ``python -m fedlight.<old>``: the new module's code, run as ``__main__``."""
        new = f"fedlight.{MOVED[name.removeprefix('fedlight.')]}"
        return importlib.util.find_spec(new).loader.get_code(new)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before any other finder (an editable install of an older checkout)
