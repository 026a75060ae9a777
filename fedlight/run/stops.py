"""Clean stops: a signal or a failed write ends a run at a safe point, with one line and a documented exit status.

A cluster stops jobs from outside: Slurm sends ``SIGTERM`` on preemption and at the time limit, submitit forwards
``SIGUSR1`` to a cell it requeues, a user presses Ctrl-C (``SIGINT``). While :func:`stop_signals` is active (the
rounds of
:meth:`~fedlight.engine.driver.FitDriver.fit`), such a signal only raises a flag; the loop looks at it after each
round, writes the checkpoint of that round if it is not on disk yet (it may not be due under ``loop.save_every``),
waits until every checkpoint and ``metrics.jsonl`` line is renamed or appended, and raises :class:`Stopped`. A second
Ctrl-C stops at once, as before (rounds up to the last checkpoint are kept).

A write that fails during the run (disk full, a read-only remount, the run directory removed) ends it through
:func:`disk_guard`: the TensorBoard writer and the background checkpoint writer are stopped without printing their
own tracebacks, and one :class:`RunDirError` names the file that failed and the last complete checkpoint.

Exit statuses of ``fedlight fit`` (also in ``fedlight --help`` and docs/clusters.md):

====  ======================================================================================================
0     finished
1     diverged (``loop.on_nonfinite: stop``); the last good checkpoint is kept
2     refused before training: a setting, a file or the run directory is wrong (the message says which)
74    a write to the run directory failed during the run (``EX_IOERR``); resume after fixing it
130   stopped by ``SIGINT`` at a safe point (128 + signal number, as a shell reports a signal)
138   stopped by ``SIGUSR1`` at a safe point
143   stopped by ``SIGTERM`` at a safe point
====  ======================================================================================================

After 74, 130, 138 and 143, ``--resume auto`` continues the run and ends bit for bit where an uninterrupted run
ends (on CPU).

The command line catches the stop signals from its first instruction (:func:`from_start`, before torch is imported):
a stop during start-up ends with the same statuses and one line. Once a stop is under way further stop signals are
ignored, and the command line process exits right after its stop line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from pathlib import Path

from fedlight.errors import ConfigError

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
STOP_STATUSES = tuple(128 + int(getattr(signal, name, 0)) for name in STOP_SIGNALS)
DISK_FAILED = 74
"""Exit status when the run directory cannot be written during the run (``EX_IOERR`` of sysexits.h)."""
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOENT, errno.EIO, errno.EACCES, errno.EPERM,
               errno.ESTALE}

EXIT_STATUSES = ("exit status: 0 finished; 1 diverged; 2 refused (bad setting or file); 74 a write to the run "
                 "directory failed during the run; 130/138/143 stopped by SIGINT/SIGUSR1/SIGTERM after a finished "
                 "round, its checkpoint written. After 74 and 130-143, continue with --resume auto")


class Stopped(Exception):
    """The run stopped at a safe point on a signal; ``status`` is the exit status of ``fedlight fit``. ``round``
    ``None``: during start-up (imports, data set-up, checks), before any round of this process."""

    def __init__(self, round: int | None, signal_name: str) -> None:
        super().__init__(f"stopped at round {round} by {signal_name}; continue with --resume auto" if round is not None
                         else f"stopped by {signal_name} during start-up, before any round; nothing is lost: run the "
                         "same command again")
        self.round = round
        self.signal_name = signal_name
        self.status = 128 + int(getattr(signal, signal_name))


class RunDirError(ConfigError):
    """A write to the run directory failed during the run; the message names the file and the last checkpoint."""

    status = DISK_FAILED


# ------------------------------------------------------------------------------------------------ signals
class StopSignals:
    """The stop flag: ``name`` is the first stop signal received (``None`` while none was)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.previous: dict[int, object] = {}

    def catch(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.name == "SIGINT":  # a second Ctrl-C: stop now
            signal.signal(signum, self.previous.get(signum, signal.default_int_handler))
            raise KeyboardInterrupt
        self.name = self.name or signal.Signals(signum).name


def from_start() -> dict[int, object]:
    """Catch :data:`STOP_SIGNALS` from the first instruction of the command line on (imports, data set-up): a stop
    signal there raises :class:`Stopped` at once (nothing to save yet). The rounds replace this with
    :func:`stop_signals`; once a stop is under way, further signals are ignored (:func:`_quiet`). Returns the
    handlers it replaced (for :func:`restore`); only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    _PENDING.clear()  # a command called again from Python (a test) starts with no stop of an earlier one
    return {sig: signal.signal(sig, _at_start) for name in STOP_SIGNALS if (sig := getattr(signal, name, None))}


def die_with_parent() -> None:
    """A process started by ``fedlight reproduce`` (or by ``fedlight fit`` for ``--devices N``) gets ``SIGTERM`` when
    the process that started it dies (Linux), and stops cleanly: ``FEDLIGHT_PARENT_PID`` names that process. The
    processes this one starts inherit this one's pid there."""
    parent = os.environ.get("FEDLIGHT_PARENT_PID")
    os.environ["FEDLIGHT_PARENT_PID"] = str(os.getpid())
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before prctl: stop now
        os.kill(os.getpid(), signal.SIGTERM)


def restore(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class StoppedAtStart(BaseException):
    """A stop signal during start-up. A ``BaseException`` like ``KeyboardInterrupt``: library code that catches
    ``Exception`` around an import (torch does) must not swallow it and go on half-imported."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.stopped = Stopped(None, signal_name)


_PENDING: list[str] = []
"""The stop signal received during start-up, until it is raised (outside any import)."""


def _at_start(signum: int, frame) -> None:
    _quiet()
    _PENDING.append(signal.Signals(signum).name)
    _raise_when_safe(signal.SIGALRM, frame)


def _raise_when_safe(signum: int, frame) -> None:
    """Raise the pending stop, unless an import is under way: a module interrupted half-way (numpy's, torch's) is
    left half-initialised, and code that catches errors around an import goes on with it. Then look again in 50 ms."""
    while frame is not None and not frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back
    if frame is not None:
        signal.signal(signal.SIGALRM, _raise_when_safe)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        return
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    raise StoppedAtStart(_PENDING[0])


def raise_pending() -> None:
    """Raise a stop signal received during start-up and not raised yet (before the first round)."""
    if _PENDING and threading.current_thread() is threading.main_thread():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        raise StoppedAtStart(_PENDING[0])


def _quiet() -> None:
    """Ignore further stop signals (a stop is under way: a second signal must not turn it into a failure)."""
    if threading.current_thread() is threading.main_thread():
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                signal.signal(sig, signal.SIG_IGN)


LEAVING = False
"""``True`` in the ``fedlight`` program, which exits right after a stopped run: further stop signals are then ignored
until the exit (a second signal must not turn a clean stop into a failure). A run called from Python (the API, or
``main([...])``) instead gives its caller's handlers back when it returns: a notebook's Ctrl-C works again."""

ACTIVE: list[StopSignals] = []
"""The flags of the runs in progress in this process (the test pause in :func:`fedlight.run.files.fault` reads it)."""


@contextlib.contextmanager
def stop_signals():
    """Catch :data:`STOP_SIGNALS` while the block runs (in the main thread only; elsewhere signals are untouched).

    Nested blocks (the runs of a lockstep group, inside the group's block) install no handlers of their own: the
    outermost block catches the signal for every run of the process, and its flag stays set until the group ends, so
    every member stops after the same round. (Each member catching for itself lost the stop: the signal reached only
    the member whose handler was installed last, and once that member left, the others no longer saw it; a GPU
    window's FedLESAM group stopped two of its three runs and the third trained on until it was killed.)"""
    raise_pending()
    flag = StopSignals()
    if threading.current_thread() is threading.main_thread() and not any(f.previous for f in ACTIVE):
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)  # Windows has no SIGUSR1
            if sig is not None:
                flag.previous[sig] = signal.signal(sig, flag.catch)
    ACTIVE.append(flag)
    try:
        yield flag
    finally:
        ACTIVE.remove(flag)
        for sig, handler in flag.previous.items():
            signal.signal(sig, handler)
        if flag.name and LEAVING:
            _quiet()


def requested() -> str | None:
    """The first stop signal received by a run in progress in this process (``None``: none)."""
    return next((f.name for f in ACTIVE if f.name), None)


def agreed(fabric) -> str | None:
    """The stop signal any process of the run received; with several processes, one small all-reduce (every
    process calls this after every round, so they stop after the same round)."""
    if fabric is None or fabric.world_size == 1:
        return requested()
    import torch

    code = STOP_SIGNALS.index(requested()) + 1 if requested() else 0
    code = int(fabric.all_reduce(torch.tensor([code], device=fabric.device), reduce_op="max").item())
    return STOP_SIGNALS[code - 1] if code else None


def stop_here(record, rounds_done: int, signal_name: str) -> None:
    """After the round's row and checkpoint were handed to ``record``: wait until they are on disk, then stop."""
    record.flush()
    record.progress.close()
    raise Stopped(rounds_done, signal_name)


# ------------------------------------------------------------------------------------------------ failed writes
@contextlib.contextmanager
def disk_guard(record):
    """Turn a failed write of the run directory (in this thread, the checkpoint writer or TensorBoard's thread)
    into one :class:`RunDirError`; the record's writer threads are stopped quietly first."""
    old_hook = threading.excepthook
    threading.excepthook = lambda args: None if issubclass(args.exc_type, OSError) else old_hook(args)
    try:
        yield
    except RunDirError as e:
        record.abort()
        raise RunDirError(f"{e} {last_checkpoint(record)}") from None
    except OSError as e:
        if not _is_disk_error(e, record.out):
            raise
        record.abort()
        where = os.fsdecode(e.filename) if e.filename else record.out  # TensorBoard names files in bytes
        raise RunDirError(f"cannot write {where}: {e.strerror or e}. Free space or fix the folder, then continue "
                          f"with `--resume auto`. {last_checkpoint(record)}") from None
    finally:
        threading.excepthook = old_hook


def _is_disk_error(e: OSError, out: Path) -> bool:
    inside = e.filename is not None and Path(os.fsdecode(e.filename)).resolve().is_relative_to(out.resolve())
    return inside or e.errno in DISK_ERRNOS


def last_checkpoint(record) -> str:
    """``The last complete checkpoint is OUT/checkpoints/last.ckpt (round K).`` (or why there is none)."""
    path = record.out / "checkpoints" / "last.ckpt"
    if not record.saved_round:
        return "No checkpoint was completed: the run starts over."
    if not path.is_file():
        return f"The last checkpoint (round {record.saved_round}) was at {path}, which is gone: the run starts over."
    return f"The last complete checkpoint is {path} (round {record.saved_round})."


def end_processes(fabric, agreed: bool) -> None:
    """With several processes, after a run they all ended the same way (finished or stopped): leave the process
    group together, so gloo's worker threads are stopped while the interpreter is whole (a group left to the
    interpreter's exit can abort it: ``terminate called without an active exception``), and let the launching
    process wait for the ranks it started, so none outlives it."""
    if fabric.world_size == 1 or not agreed:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for proc in getattr(getattr(fabric.strategy, "launcher", None), "procs", None) or []:
        proc.wait()
