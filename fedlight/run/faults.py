"""Fault injection for the kill-, signal- and disk-safety tests, driven by ``FEDLIGHT_FAULT``.

``<point>@<round>[:<action>]`` — points: ``setup@0`` (start-up, after the data set-up), ``train`` (after the
round's first client), ``eval`` (inside evaluation), ``ckpt`` (checkpoint written to its temporary file, not yet
renamed), ``metrics`` (checkpoint renamed, metrics row not yet appended). Actions: ``kill`` (the default: SIGKILL
the process there), ``enospc`` (the write fails there as on a full disk), ``pause`` (wait there once, up to 300 s,
until a stop signal arrives, after creating the file named by ``FEDLIGHT_FAULT_READY``: a signal test then knows
where the run is), ``hold`` (wait there once, up to 300 s, until the test removes the file named by
``FEDLIGHT_FAULT_READY``, which it creates: the test changes the world mid-run, e.g. makes a tracker's store
read-only, and lets the run go on).

``write:<file name>:<ERRNO>[:<n>]`` — the ``n``-th write (default the first) to a file of that name (``last.ckpt``,
``final_model.pt``, ``summary.json``, ``config.yaml``, ``metrics.jsonl``, ``table.md``, ``.fedlight.lock``: its
removal, ...) fails with that errno
(``ENOSPC``, ``EDQUOT``, ``EROFS``, ``EIO``), exactly where a real disk would fail it; ``KILL`` SIGKILLs the
process there instead (TensorBoard's event file is named ``tfevents``; its error is raised inside TensorBoard's own
writer thread, :class:`FaultyFile`).

Before a kill, the run's background writer drains (:data:`DRAIN`), so the kill falls exactly at the named point
with earlier checkpoints durable.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

DRAIN: list = []
"""Callables that wait for the background writes of the runs in progress in this process."""

_writes: dict[str, int] = {}


def fault(point: str, round: int) -> None:
    """The fault named by ``FEDLIGHT_FAULT`` for ``point`` of round ``round``, if any."""
    where, _, action = os.environ.get("FEDLIGHT_FAULT", "").partition(":")
    if where != f"{point}@{round}":
        return
    for drain in list(DRAIN):  # earlier checkpoints and metrics lines are durable first
        drain()
    if action == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device")
    if action in ("pause", "hold"):
        _pause(until_removed=action == "hold")
        return
    os.kill(os.getpid(), signal.SIGKILL)


def on_write(path: Path) -> None:
    """Raise the injected write error for ``path``, if ``FEDLIGHT_FAULT`` names its file (see the module)."""
    spec = os.environ.get("FEDLIGHT_FAULT", "")
    if not spec.startswith("write:"):
        return
    name, code, *nth = spec[len("write:"):].split(":")
    if Path(path).name != name:
        return
    _writes[name] = _writes.get(name, 0) + 1
    if _writes[name] == int(nth[0] if nth else 1):
        if code == "KILL":  # killed inside the write: its temporary file stays behind
            os.kill(os.getpid(), signal.SIGKILL)
        number = getattr(errno, code)
        raise OSError(number, os.strerror(number), str(path))


class FaultyFile:
    """A file object whose writes go through :func:`on_write` for ``path`` first: set inside a library's own writer
    (TensorBoard's event-file thread), the injected error is raised where a real disk would raise it."""

    def __init__(self, file, path: Path) -> None:
        self.file, self.path = file, path

    def write(self, data):
        on_write(self.path)
        return self.file.write(data)

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def _pause(until_removed: bool = False) -> None:
    import torch.distributed as dist

    from fedlight.run import stops

    if os.environ.pop("FEDLIGHT_FAULT", None) is None or (dist.is_initialized() and dist.get_rank() != 0):
        return  # once, and on global rank 0 only (the others wait for it in the round's all-reduce)
    ready = Path(os.environ.get("FEDLIGHT_FAULT_READY") or os.devnull)
    if ready != Path(os.devnull):
        ready.touch()
    deadline = time.monotonic() + 300  # a bound on a hang only: far beyond any wait of a loaded machine
    while not stops.requested() and time.monotonic() < deadline and (not until_removed or ready.exists()):
        time.sleep(0.02)
