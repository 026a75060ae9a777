"""Retired import paths: modules that lived at ``fedlight.<name>`` before the package was grouped into ``core/``,
``engine/`` and ``config/``, and the modules of ``lab/`` before its packages (``lab.<module>``).

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
    # lab/'s modules before its packages (issue 61)
    "lab.bench": "lab.benchmarks.cli", "lab.bench_cpu": "lab.benchmarks.cpu", "lab.bench_fit": "lab.benchmarks.fit",
    "lab.bench_gpu": "lab.benchmarks.gpu", "lab.bench_nlp": "lab.benchmarks.nlp",
    "lab.bench_peers": "lab.benchmarks.peers", "lab.bench_pfl": "lab.benchmarks.pfl",
    "lab.bench_routes": "lab.benchmarks.routes", "lab.bench_work": "lab.benchmarks.work",
    "lab.route_candidates": "lab.benchmarks.route_candidates", "lab.triton_wgrad": "lab.benchmarks.triton_wgrad",
    "lab.workload": "lab.benchmarks.workload", "lab.landscape": "lab.flatness.landscape",
    "lab.landscape_run": "lab.flatness.run", "lab.flatness_cli": "lab.flatness.cli",
    "lab.table_spec": "lab.tables.spec", "lab.runner": "lab.tables.runner", "lab.jobs": "lab.tables.jobs",
    "lab.slurm": "lab.tables.slurm", "lab.gpu_share": "lab.tables.gpu_share", "lab.reproduce": "lab.tables.reproduce",
    "lab.table_report": "lab.tables.table_report", "lab.report": "lab.tables.report",
    "lab.report_plot": "lab.tables.report_plot", "lab.tune": "lab.tuning.cli", "lab.tune_space": "lab.tuning.space",
    "lab.tune_study": "lab.tuning.study", "lab.tune_report": "lab.tuning.report",
    "lab.lockstep_runs": "lab.tables.lockstep_runs",
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
