"""LoopState: everything a run carries from one round to the next, and the only author of a checkpoint.

:class:`~fedlight.engine.loop.FederatedLoop` advances it one round at a time (and counts its totals); the fit driver
(:class:`~fedlight.engine.driver.FitDriver`) hands :meth:`LoopState.snapshot` to the run record, which writes the
bytes, and on resume compares a checkpoint with it (:func:`resume_problems`, the one check) before
:meth:`LoopState.restore`. ``snapshot`` and ``restore`` are exact inverses over :data:`CHECKPOINT_KEYS`; a checkpoint
with any other key, or without one of them, is refused.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from fedlight.core.rules import ServerRule
from fedlight.engine.client_store import ClientStateStore
from fedlight.errors import ConfigError
from fedlight.run.directory import differences
from fedlight.run.files import CHECKPOINT_FORMAT, cpu_copy, meta_differences, to_device
from fedlight.run.rows import dumps

CHECKPOINT_KEYS = ("format", "round", "params", "buffers", "int_buffers", "server", "store", "totals", "meta",
                   "settings", "segments", "last_row", "run_id", "task")
"""Every key of a checkpoint (format 1), written by :meth:`LoopState.snapshot` and read by :meth:`LoopState.restore`;
a new key is added here and in both methods."""
OPTIONAL_KEYS = ("run_id", "task")
"""Keys a checkpoint written before them lacks (it resumes as before)."""


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
    """Bytes up/down and wall time over the whole run (resumed runs included), counted by the loop; the wall time
    here is that of the rounds before :attr:`clock` started (:meth:`totals_now` adds the time since)."""
    rounds_done: int = 0
    """Rounds completed: the next round to train is ``rounds_done`` (0-based)."""
    last_row: dict[str, Any] | None = None
    """The metrics row of round ``rounds_done`` (set by the loop, completed by the driver before a snapshot;
    re-appended on resume when ``metrics.jsonl`` lacks it)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The settings that define the run (a resume must agree on them; empty: not known)."""
    segments: list[dict[str, Any]] = field(default_factory=list)
    """The execution-only settings of each stretch of the run (:meth:`begin_segment`)."""
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))
    """The run's identity, kept through every resume: config.yaml, summary.json and each checkpoint carry it, so
    ``fedlight verify`` tells another run's file copied in (a checkpoint from before it: a new one from the resume)."""
    task: Any = field(default=None, repr=False)
    """The run's task: what it keeps across rounds (a LightningModule's ``on_save_checkpoint`` extras, its DataModule's
    state) is the checkpoint's ``task`` (``Task.checkpoint_state`` / ``Task.load_checkpoint_state``)."""
    clock: float | None = field(default=None, repr=False)
    """``time.perf_counter()`` when this process's first round began (``None``: not yet); not checkpointed."""

    def totals_now(self) -> dict[str, Any]:
        """:attr:`totals` with the wall time brought up to now."""
        since = 0.0 if self.clock is None else time.perf_counter() - self.clock
        return {**self.totals, "wall_time_s": self.totals["wall_time_s"] + since}

    def begin_segment(self, execution: dict[str, Any]) -> None:
        """Open a stretch of the run at round :attr:`rounds_done` with the execution-only settings ``execution``,
        listing what changed since the previous stretch (a resume)."""
        execution = {k: v for k, v in execution.items() if k not in ("resume", "overwrite")}
        seg: dict[str, Any] = {"from_round": self.rounds_done, "settings": execution}
        if self.segments:
            prev = self.segments[-1]["settings"]
            seg["changed"] = sorted(k for k in prev.keys() | execution.keys()
                                    if _text(prev.get(k)) != _text(execution.get(k)))
        self.segments = [*self.segments, json.loads(_text(seg))]

    def snapshot(self) -> dict[str, Any]:
        """The checkpoint of this state (every key of :data:`CHECKPOINT_KEYS`), as private CPU copies and JSON text
        (safe to write while the next round runs)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "round": self.rounds_done,
            "params": cpu_copy(self.params),
            "buffers": cpu_copy(self.buffers),
            "int_buffers": cpu_copy(self.int_buffers),
            "server": cpu_copy(self.server.state_dict()),
            "store": self.store.state_dict(),  # states are replaced on put, never changed in place
            "totals": self.totals_now(),
            "meta": self.meta,
            "settings": _text(self.settings),
            "segments": json.dumps(self.segments),
            "last_row": dumps(self.last_row) if self.last_row is not None else "",
            "run_id": self.run_id,
            "task": self.task.checkpoint_state() if self.task is not None else {},
        }

    def restore(self, ckpt: dict[str, Any], device: Any) -> None:
        """Continue from ``ckpt`` (checked first with :func:`resume_problems`); one whose keys are not
        :data:`CHECKPOINT_KEYS` is refused."""
        problem = key_problem(ckpt)
        if problem:
            raise ConfigError(f"the checkpoint {problem}")
        self.params = {k: v.to(device) for k, v in ckpt["params"].items()}
        self.buffers = {k: v.to(device) for k, v in ckpt["buffers"].items()}
        for k, v in ckpt["int_buffers"].items():
            self.int_buffers[k].copy_(v)
        self.server.load_state_dict(to_device(ckpt["server"], device))
        self.store.load_state_dict(ckpt["store"])
        self.totals, self.clock = dict(ckpt["totals"]), None
        self.meta = dict(ckpt["meta"])
        self.rounds_done = int(ckpt["round"])
        self.settings = json.loads(ckpt["settings"])
        self.segments = json.loads(ckpt["segments"])
        self.last_row = json.loads(ckpt["last_row"]) if ckpt["last_row"] else None
        self.run_id = ckpt.get("run_id") or self.run_id
        if self.task is not None and ckpt.get("task"):
            self.task.load_checkpoint_state(ckpt["task"], None)


def _text(value: Any) -> str:
    return json.dumps(value, default=str)


def key_problem(ckpt: dict[str, Any]) -> str:
    """Why ``ckpt``'s keys are not a checkpoint's (unknown or missing ones, named), or ``""``."""
    unknown = sorted(set(ckpt) - set(CHECKPOINT_KEYS))
    missing = [k for k in CHECKPOINT_KEYS if k not in ckpt and k not in OPTIONAL_KEYS]
    if not unknown and not missing:
        return ""
    what = "; ".join(([f"has keys this fedlight does not know: {', '.join(unknown)}"] if unknown else [])
                     + ([f"lacks keys: {', '.join(missing)}"] if missing else []))
    return (f"{what} (a checkpoint holds exactly {', '.join(CHECKPOINT_KEYS)}). Resume it with the fedlight "
            "version that wrote it, or start a new run")


def resume_problems(ckpt: dict[str, Any], meta: dict[str, Any], settings: dict[str, Any] | None) -> list[str]:
    """Why ``ckpt`` (its keys checked first with :func:`key_problem`) cannot continue this run: its model and clients
    (``meta``), then its defining settings (when both sides have them); empty when it can."""
    problems = meta_differences(ckpt["meta"], meta)
    there = json.loads(ckpt["settings"])
    if not problems and settings and there:
        problems = differences(there, settings)
    return problems


def step_counters(model) -> dict:
    """BatchNorm step counters: never averaged; advanced by one client's K per round. Other integer buffers (e.g.
    Swin's relative_position_index) are constants and are left alone."""
    return {n: b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}
