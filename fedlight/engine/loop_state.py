"""LoopState: everything a run carries from one round to the next, and the only thing a checkpoint holds.

:class:`~fedlight.engine.loop.FederatedLoop` advances it one round at a time; the fit driver
(:class:`~fedlight.engine.driver.FitDriver`) snapshots it for the run record and, on resume, compares a checkpoint
with it (:func:`resume_problems`, the one check) before restoring it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from fedlight.core.rules import ServerRule
from fedlight.engine.client_store import ClientStateStore
from fedlight.run.directory import differences
from fedlight.run.files import CHECKPOINT_FORMAT, cpu_copy, meta_differences, to_device


def _totals() -> dict[str, Any]:
    return {"bytes_up": 0, "bytes_down": 0, "wall_time_s": 0.0}


@dataclass(eq=False)
class LoopState:
    """The global model and everything else that survives a round."""

    params: dict[str, Tensor]
    """``x_r``: the global trainable parameters."""
    buffers: dict[str, Tensor]
    """The global floating-point buffers (BatchNorm statistics)."""
    int_buffers: dict[str, Tensor]
    """BatchNorm step counters: the model's own tensors, advanced in place by one client's ``K`` per round."""
    server: ServerRule
    """The server rule, whose ``state_dict`` is the server state (momenta, control variates, ...)."""
    store: ClientStateStore
    """Every client's persistent state."""
    meta: dict[str, Any]
    """What a checkpoint must agree on to be resumed here (algorithm, model, shapes, clients, seed)."""
    totals: dict[str, Any] = field(default_factory=_totals)
    """Bytes up/down and wall time over the whole run (resumed runs included)."""
    rounds_done: int = 0
    """Rounds completed: the next round to train is ``rounds_done`` (0-based)."""
    last_row: dict[str, Any] | None = None
    """The metrics row of round ``rounds_done``, as the checkpoint carried it (re-appended on resume if missing)."""

    def snapshot(self) -> dict[str, Any]:
        """The checkpoint of this state, as private CPU copies (safe to write while the next round runs)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "round": self.rounds_done,
            "params": cpu_copy(self.params),
            "buffers": cpu_copy(self.buffers),
            "int_buffers": cpu_copy(self.int_buffers),
            "server": cpu_copy(self.server.state_dict()),
            "store": self.store.state_dict(),  # states are replaced on put, never changed in place
            "totals": dict(self.totals),
            "meta": self.meta,
        }

    def restore(self, ckpt: dict[str, Any], device: Any) -> None:
        """Continue from ``ckpt`` (checked first with :func:`resume_problems`)."""
        self.params = {k: v.to(device) for k, v in ckpt["params"].items()}
        self.buffers = {k: v.to(device) for k, v in ckpt["buffers"].items()}
        for k, v in ckpt["int_buffers"].items():
            self.int_buffers[k].copy_(v)
        self.server.load_state_dict(to_device(ckpt["server"], device))
        self.store.load_state_dict(ckpt["store"])
        self.totals = dict(ckpt["totals"])
        self.rounds_done = int(ckpt["round"])
        self.last_row = json.loads(ckpt["last_row"]) if ckpt.get("last_row") else None


def resume_problems(ckpt: dict[str, Any], meta: dict[str, Any], settings: dict[str, Any] | None) -> list[str]:
    """Why ``ckpt`` cannot continue this run: its model and clients (``meta``), then its defining settings (when
    both sides have them); empty when it can."""
    problems = meta_differences(ckpt["meta"], meta)
    if not problems and settings is not None and ckpt.get("settings"):
        problems = differences(json.loads(ckpt["settings"]), settings)
    return problems
