"""Where each run of a table stands: ``job.json`` in its folder, and the ``fedlight reproduce --status`` view.

Every launcher writes the same small record, so the view needs no scheduler: ``pending`` (submitted, with the job
id), ``running`` (host and process), ``stopped`` (by a signal after a finished round; requeued or resumable),
``done``/``diverged``/``failed`` (with the process's exit status). ``fedlight reproduce --status`` reads them
together with the run's own files: rounds finished (``metrics.jsonl``), the summary, the last line of ``fit.log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

JOB_FILE = "job.json"
LIVE = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "UNKNOWN", "PREEMPTED", "SUSPENDED",
        "REQUEUE_HOLD", "SIGNALING", "STAGE_OUT")
"""Scheduler states of a job that is still to run or running."""


def host() -> str:
    return socket.gethostname()


def alive(record: dict[str, Any]) -> bool:
    """Whether the process a ``running`` record names may still run: ``False`` only when it ran on this host and
    its process is gone: no process has its id any more (killed with its launcher, a machine restart), the process
    ended and waits to be reaped (a zombie: where no one reaps orphans, e.g. a container whose first process does
    not, a killed job's orphaned process stays one), or the id is now another process's (its start time differs
    from the record's ``start``, when it has one); another host's cannot be seen."""
    pid = record.get("pid")
    if record.get("host") != host() or not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        pass
    state = proc_state(pid)
    if state is None:
        return True
    return state[0] not in "ZX" and record.get("start") in (None, state[1])


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of process ``pid``, from ``/proc`` (None: unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def start_time() -> int | None:
    """This process's start time (clock ticks since boot; with its id it names the process, never a later one)."""
    state = proc_state(os.getpid())
    return state[1] if state else None


def read(path: Path) -> dict[str, Any]:
    f = Path(path) / JOB_FILE
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def mark(path: Path, **fields: Any) -> None:
    """Merge ``fields`` into the run's ``job.json`` (atomically), stamped with the time."""
    from fedlight.run.files import atomic_write_text

    record = {**read(path), **fields, "updated": time.strftime("%Y-%m-%d %H:%M:%S")}
    atomic_write_text(Path(path) / JOB_FILE, json.dumps(record, indent=1) + "\n")


def last_line(path: Path, name: str = "fit.log") -> str:
    f = Path(path) / name
    if not f.is_file():
        return ""
    lines = [ln.strip() for ln in f.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def rounds_done(path: Path) -> int:
    """Rounds with a row in the run's ``metrics.jsonl`` (a damaged line is not a round)."""
    from fedlight.run.files import read_rows

    return len(read_rows(Path(path) / "metrics.jsonl")[0])


def state(run, scheduler=None) -> tuple[str, str]:
    """``(state, detail)`` of one run (a :class:`fedlight.lab.tables.runner.Run`). ``scheduler(job_id)`` may name the
    scheduler's own state of a pending or running job (Slurm: ``PENDING``, ``RUNNING``, ``FAILED``, ..., then
    details)."""
    from fedlight.lab.tables import report as rep

    if not run.valid():
        return "conflict", "made by another command (reproduce.json)"
    if run.finished():
        diverged = (rep.read_summary(run.path) or {}).get("diverged_at_round")
        return ("diverged", f"at round {diverged}") if diverged else ("done", "")
    job, done = read(run.path), rounds_done(run.path)
    where = f"{done} rounds done" + (f", job {job['job']}" if job.get("job") else "")
    st = job.get("state")
    if st in (None, "skipped"):
        return ("not started", "") if not done else ("stopped", where)
    if st in ("pending", "running") and scheduler is not None and job.get("job"):
        seen = scheduler(str(job["job"]))
        if seen and seen.split()[0].upper() not in LIVE:
            return "failed", f"{where}; the scheduler reports {seen}: {last_line(run.path) or 'no fit.log'}"
    if st == "running" and not alive(job):
        return "stopped", (f"{where}; its launcher (process {job.get('pid')}) ended without recording it; the same "
                           "command resumes it")
    if st == "running":
        return "running", f"{where} on {job.get('host', '?')}"
    if st in ("failed", "done", "diverged"):  # done/diverged per job.json but not finished: files were removed
        return "failed", f"exit status {job.get('rc')}: {last_line(run.path) or 'no fit.log'}"
    return st, where + (f"; {job['note']}" if job.get("note") else "")


def settle(runs) -> None:
    """Record in ``job.json`` what each run whose local launcher is gone did, as its files show (stopped after its
    last finished round, or done): a record never names a dead process as running (a launcher killed, or stopped
    before it could record it). Slurm jobs are left to the scheduler's view."""
    for r in {r.path: r for r in runs}.values():
        job = read(r.path)
        if job.get("state") == "running" and not job.get("job") and not alive(job):
            st, detail = state(r)
            mark(r.path, state=st, note=detail)


def holding(runs) -> str:
    """What ``runs`` hold: ``2 stopped after a finished round (a seed0 at round 3, ...), 1 finished, 0 not
    started``."""
    todo = list({r.path: r for r in runs}.values())
    done = [r for r in todo if r.finished()]
    partial = [(r, rounds_done(r.path)) for r in todo if not r.finished() and rounds_done(r.path)]
    where = ", ".join(f"{r.label} at round {k}" for r, k in partial[:4]) + (", ..." if len(partial) > 4 else "")
    return (f"{len(partial)} stopped after a finished round{f' ({where})' if partial else ''}, {len(done)} finished, "
            f"{len(todo) - len(done) - len(partial)} not started")


def status_table(runs, scheduler=None) -> str:
    """One line per run folder: ``row/column seedK  state  detail``, then the counts."""
    todo = list({r.path: r for r in runs}.values())
    lines, counts = [], {}
    width = max((len(f"{r.cell.run_key} seed{r.seed}") for r in todo), default=10)
    for r in todo:
        st, detail = state(r, scheduler)
        job = read(r.path).get("job") if scheduler is not None else None
        if job and (seen := scheduler(str(job))) and seen not in detail:
            detail = f"{detail}; Slurm: {seen}" if detail else f"Slurm: {seen}"
        counts[st] = counts.get(st, 0) + 1
        lines.append(f"{r.cell.run_key + ' seed' + str(r.seed):<{width}}  {st:<11} {detail}".rstrip())
    lines.append(f"{len(todo)} runs: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


class Children:
    """The ``fedlight fit`` processes a launcher started (``fedlight reproduce``'s pool, a Slurm job). While
    :meth:`forwarding`, a stop signal is passed on to every one of them (each stops after its round in progress, its
    checkpoint written) and no further run starts; the launcher then waits for them, so none outlives it.
    ``signals``: the ones forwarded (default SIGTERM, SIGINT, SIGUSR1); ``popen``: extra ``Popen`` arguments of
    every child."""

    def __init__(self, signals: tuple[str, ...] | None = None, **popen: Any) -> None:
        from fedlight.run.stops import STOP_SIGNALS

        self.signals = STOP_SIGNALS if signals is None else signals
        self.popen = popen
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.signal: str | None = None

    def call(self, cmd: list[str], watch=None, **kw: Any) -> int | None:
        """Run ``cmd`` and wait for it; ``None`` (not started) once a stop signal came. ``watch(proc)``, if given,
        is called twice a second while it runs (``fedlight tune`` reads the run's evaluations and may stop it)."""
        with self.lock:
            if self.signal:
                return None
            proc = subprocess.Popen(cmd, **kw, **self.popen, process_group=0)  # a terminal's Ctrl-C: forwarded once
            self.procs.add(proc)
        try:
            while watch is not None:
                try:
                    return proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    watch(proc)
            return proc.wait()
        finally:
            with self.lock:
                self.procs.discard(proc)

    def live(self) -> list[subprocess.Popen]:
        return [p for p in list(self.procs) if p.poll() is None]

    def forward(self, signum: int, frame=None) -> None:
        self.signal = self.signal or signal.Signals(signum).name
        for proc in self.live():
            proc.send_signal(signum)

    @contextlib.contextmanager
    def forwarding(self):
        main = threading.current_thread() is threading.main_thread()
        sigs = [getattr(signal, name) for name in self.signals if hasattr(signal, name)] if main else []
        previous = {sig: signal.signal(sig, self.forward) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_IGN if self.signal else handler)  # a stop is under way: stay quiet
