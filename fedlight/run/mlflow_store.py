"""MLflow's side of the trackers (:mod:`fedlight.run.trackers`): the store a logger given no tracking URI uses,
where a SQLite store's artifacts go, and MLflow's own log lines kept quiet."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any


def fill(args: dict[str, Any], init_args: dict[str, Any], known: dict[str, Any]) -> str | None:
    """Complete an MLflow logger's constructor ``args`` in place: no tracking URI given (nor a ``save_dir``), the
    store of ``known`` (a resumed run's, from ``trackers.json``) or MLflow's default store, with one note line; a
    SQLite store keeps its artifacts beside it. Returns the default store used, else ``None``."""
    used = None
    if not args.get("tracking_uri") and "save_dir" not in init_args:
        uri = used = args["tracking_uri"] = known.get("tracking_uri") or default_store()
        print(f"fedlight: note: mlflow: logging to {uri}, MLflow's default store (MLFLOW_TRACKING_URI or the "
              f"logger's tracking_uri chooses another; `mlflow ui --backend-store-uri {uri}` shows it)",
              file=sys.stderr, flush=True)
    uri = str(args.get("tracking_uri") or "")
    if uri.startswith("sqlite:///") and not args.get("artifact_location"):
        args["artifact_location"] = _beside(uri)  # else MLflow puts them in ./mlruns of the working directory
    return used


def default_store() -> str:
    """The store MLflow itself uses where no tracking URI is set: ``sqlite:///mlflow.db`` in the working directory
    (an existing ``./mlruns`` file store instead, as MLflow decides), as an absolute URI. Lightning's
    ``MLFlowLogger`` would use a ``./mlruns`` file store, which MLflow 3 refuses."""
    import mlflow

    return mlflow.get_tracking_uri()


def _beside(sqlite_uri: str) -> str:
    """``mlruns/`` next to the SQLite database of ``sqlite:///PATH`` (relative paths: from the working directory),
    as a ``file://`` URI: where a new experiment keeps its artifacts."""
    return (Path(sqlite_uri[len("sqlite:///"):]).resolve().parent / "mlruns").as_uri()


@contextlib.contextmanager
def quiet():
    """MLflow logs a failed store call with its traceback, then raises it: fedlight reports it once, in one line.
    Also MLflow's INFO lines as it creates a new store's tables."""
    import logging

    log = logging.getLogger("mlflow")
    level, log.level = log.level, logging.CRITICAL + 1
    try:
        yield
    finally:
        log.setLevel(level)
