"""A run that waits for its study's answer after each evaluation it reports (``fedlight tune``), so that whether a
trial is pruned, and after which round, never depends on how fast the run goes beside the study.

``fedlight tune`` starts a trial's run with ``FEDLIGHT_TUNE_GATE`` naming a file in its folder (:data:`NAME`):
``{"key": <the evaluation the study reads>, "round": <the last round answered>, "prune": <bool>}``. After each round
whose row carries ``key`` (but the last), the run writes that round's checkpoint and row, then waits until the file
answers the round (:func:`wait`): it trains on, or stops there like a run sent ``SIGUSR1`` (exit 138, its
checkpoint written). The study answers (:func:`answer`) once it has read and reported the row.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "FEDLIGHT_TUNE_GATE"
NAME = "tune_gate.json"
PRUNED = "SIGUSR1"
"""How a pruned run stops: as ``SIGUSR1`` stops it (after the round, its checkpoint written; exit 138)."""


def open_gate(run_dir: Path, key: str) -> dict[str, str]:
    """Make the run folder's gate (nothing answered yet); returns the environment that points the run at it."""
    path = Path(run_dir) / NAME
    _write(path, {"key": key, "round": 0, "prune": False})
    return {ENV: str(path)}


def answer(run_dir: Path, round: int, prune: bool) -> None:
    """The study's answer to the run's row of ``round``: stop there (``prune``) or go on."""
    path = Path(run_dir) / NAME
    _write(path, {**(_read(path) or {}), "round": int(round), "prune": bool(prune)})


def asks(row: dict[str, Any]) -> bool:
    """Whether this run waits for the study after the round of ``row`` (its gate's evaluation is in the row)."""
    gate = _read(os.environ.get(ENV))
    return gate is not None and row.get(gate.get("key")) is not None


def wait(round: int, interrupted) -> str | None:
    """Wait until the study answered ``round``: :data:`PRUNED` when it prunes the trial there, else ``None``; a stop
    signal (``interrupted()`` true) ends the wait too (the caller stops for it)."""
    path = os.environ.get(ENV)
    while not interrupted():
        gate = _read(path)
        if gate is not None and int(gate.get("round", 0)) >= round:
            return PRUNED if gate.get("prune") and int(gate["round"]) == round else None
        time.sleep(0.05)
    return None


def _read(path: str | Path | None) -> dict[str, Any] | None:
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, obj: dict[str, Any]) -> None:
    from fedlight.run.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(obj) + "\n")
