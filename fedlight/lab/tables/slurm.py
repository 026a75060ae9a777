"""``fedlight reproduce --launcher slurm``: a table's runs as Slurm jobs through submitit (``pip install
fedlight[slurm]``), each job requeued with ``--resume auto`` when it is preempted or reaches its time limit.

A job holds one run (a cell's seed), or, with ``--per-gpu N``, up to N runs per GPU side by side (small cells do not
fill a GPU). Each run is the same ``fedlight fit ... --resume auto`` process as with ``--launcher local``, writing
``fit.log`` and ``job.json`` in its run folder. When Slurm announces the end of a job (submitit asks for
``--signal USR2`` before the time limit; preemption), :meth:`CellJob.checkpoint` sends each run ``SIGUSR1``: the run
stops after its round in progress, its checkpoint written (see :mod:`fedlight.run.stops`), and submitit requeues the
job, which resumes every unfinished run. This module imports submitit; nothing imports it unless asked for a Slurm
launch. It does not import :mod:`fedlight.lab.tables.runner` either: the launcher hands each job the functions that run
a run and build its environment (pickled by name with the job).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError, check

try:
    import submitit
except ImportError:  # pragma: no cover - the message says what to install
    raise ConfigError("`--launcher slurm` needs submitit: pip install 'fedlight[slurm]' (or pip install "
                      "submitit)") from None

STOP_WAIT_S = 60
"""How long a job waits for its runs to stop after the end-of-job signal (submitit signals 120 s before the end)."""


@dataclass
class Resources:
    """What each job asks Slurm for; a table spec's ``slurm:`` mapping, overridden by the flags of the same name."""

    partition: str | None = None
    time: str | int = "4:00:00"  # sbatch's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
    gpus: int = 0  # per job
    cpus: int | None = None  # per job
    mem: str | int | None = None  # per job: GB as a plain number, or with sbatch's unit (4G, 4000M, 1T)
    account: str | None = None
    sbatch: dict[str, Any] = field(default_factory=dict)  # further sbatch options, e.g. {qos: high}
    per_gpu: int = 1  # runs per GPU (per job when gpus is 0)
    requeues: int = 10  # time-limit requeues per job (preemptions do not count)
    signal_s: int = 120  # Slurm signals a job this long before its time limit: its runs stop, it is requeued

    def minutes(self) -> int:
        t = self.time
        if isinstance(t, int):
            return t
        days, _, hms = str(t).rpartition("-")
        ok = all(p.isdigit() for p in [*hms.split(":"), *([days] if days else [])]) and hms.count(":") <= 2
        check(ok, f"`--time` (or the spec's `slurm.time`) {t!r}: give it as sbatch does: minutes, MM:SS, HH:MM:SS, "
              "D-HH, D-HH:MM or D-HH:MM:SS, e.g. 4:00:00")
        parts = [int(p) for p in hms.split(":")]
        if days:  # D-H, D-H:M, D-H:M:S
            h, m, s = parts + [0] * (3 - len(parts))
        else:  # M, M:S, H:M:S (as sbatch reads them)
            h, m, s = [0, *parts] if len(parts) == 2 else ([0, parts[0], 0] if len(parts) == 1 else parts)
        return (int(days or 0) * 24 + h) * 60 + m + (s > 0)

    def mem_text(self) -> str | None:
        """``--mem`` as sbatch takes it: a plain number is GB (``64`` → ``64G``), a unit passes unchanged."""
        m = self.mem
        if m is None:
            return None
        check(re.fullmatch(r"[0-9]+[KMGTkmgt]?", str(m)) is not None and not str(m).startswith("0"),
              f"`--mem` (or the spec's `slurm.mem`) {m!r}: give GB as a number (64) or sbatch's form with a unit: "
              "64G, 4000M, 1T")
        return f"{m}G" if str(m).isdigit() else str(m)

    def per_job(self) -> int:
        return self.per_gpu * max(self.gpus, 1)


def resources(spec: dict[str, Any], flags: dict[str, Any]) -> Resources:
    """The spec's ``slurm:`` mapping with the flags that were given on top; unknown keys are refused."""
    given = dict(spec.get("slurm") or {})
    known = {f.name for f in fields(Resources)}
    check(not set(given) - known, f"table spec `slurm:` has unknown keys {sorted(set(given) - known)} "
          f"(known: {', '.join(sorted(known))})")
    res = Resources(**{**given, **{k: v for k, v in flags.items() if v is not None}})
    check(res.per_gpu >= 1 and res.gpus >= 0 and res.requeues >= 0,
          "`--per-gpu` must be ≥ 1, `--gpus` and `--requeues` ≥ 0")
    res.mem_text()  # a bad --mem or --time fails here, before anything is submitted
    check(0 < res.signal_s < res.minutes() * 60, f"`--time` {res.time} leaves no room for the end-of-job signal "
          f"{res.signal_s} s before it (spec `slurm.signal_s`): give a longer time, or a smaller signal_s")
    return res


def executor_parameters(res: Resources) -> dict[str, Any]:
    params = {"timeout_min": res.minutes(), "nodes": 1, "tasks_per_node": 1, "name": "fedlight",
              "gpus_per_node": res.gpus or None, "cpus_per_task": res.cpus, "slurm_mem": res.mem_text(),
              "slurm_partition": res.partition, "slurm_account": res.account, "slurm_signal_delay_s": res.signal_s,
              "slurm_additional_parameters": dict(res.sbatch) or None}
    return {k: v for k, v in params.items() if v is not None}


def groups(runs: list, per_job: int) -> list[list]:
    """Runs in jobs of ``per_job`` (the order of the table, so a cell's seeds share jobs)."""
    return [runs[i:i + per_job] for i in range(0, len(runs), per_job)]


def slot_env(env: dict[str, str], slot: int, res: Resources, size: int) -> dict[str, str]:
    """The environment of the ``slot``-th run of a job: its GPU (of those Slurm gave the job) and its CPU threads."""
    env = dict(env)
    if res.gpus:
        visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g] or \
            [str(g) for g in range(res.gpus)]
        env["CUDA_VISIBLE_DEVICES"] = visible[(slot // res.per_gpu) % len(visible)]
    if "OMP_NUM_THREADS" not in os.environ:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cpus // size))
    return env


class CellJob(submitit.helpers.Checkpointable):
    """One job: its runs as ``fedlight fit`` processes side by side; requeued (with every unfinished run resuming)
    through submitit's checkpoint hook. ``run_one(run, env, call=, mark=)`` runs one run and ``run_env(jobs)`` builds
    the processes' environment (the launcher's own, :func:`fedlight.lab.tables.runner.run_one` and ``run_env``)."""

    def __init__(self, runs: list, res: Resources, run_one: Callable, run_env: Callable) -> None:
        from fedlight.lab.tables.jobs import Children

        self.runs, self.res, self.run_one, self.run_env = runs, res, run_one, run_env
        # SIGINT/SIGUSR1 to the job process go on to its runs; SIGTERM stays submitit's (ignored: the scheduler
        # signals every process of the job itself, and its requeue signal may follow)
        self._children = Children(("SIGINT", "SIGUSR1"), preexec_fn=_ignore_end_signal)
        self._rc: dict[int, int | None] = {}
        self._requeueing = False

    def __getstate__(self) -> dict[str, Any]:  # what submitit pickles: no process handles
        return {"runs": self.runs, "res": self.res, "run_one": self.run_one, "run_env": self.run_env}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __call__(self) -> dict[str, str]:
        with self._children.forwarding(), ThreadPoolExecutor(len(self.runs)) as pool:
            statuses = list(pool.map(self._one, range(len(self.runs))))
        if self._children.signal:  # the job was told to stop: its runs stopped after their round, recorded
            raise RuntimeError(f"stopped by {self._children.signal}: the runs stopped after a finished round; rerun "
                               "the same `fedlight reproduce` command to resume them")
        if "stopped" in statuses:  # stopped by the scheduler's SIGTERM: submitit's requeue signal may follow
            time.sleep(STOP_WAIT_S)
        bad = [f"{r.cell.run_key} seed{r.seed}: {s}" for r, s in zip(self.runs, statuses)
               if s not in ("done", "diverged", "skipped")]
        if bad:
            raise RuntimeError(f"runs not finished ({'; '.join(bad)}); see fit.log in their folders and rerun "
                               "the same `fedlight reproduce` command to resume them")
        return {str(r.path): s for r, s in zip(self.runs, statuses)}

    def _one(self, slot: int) -> str:
        from fedlight.lab.tables import jobs

        run = self.runs[slot]
        env = slot_env(self.run_env(1), slot, self.res, len(self.runs))
        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID")
        jobs.mark(run.path, state="running", pid=os.getpid(), host=jobs.host(), job=job, note="")
        status = self.run_one(run, env, call=lambda cmd, **kw: self._call(slot, cmd, **kw), mark=False)
        if not self._requeueing:
            jobs.mark(run.path, state=status, rc=self._rc.get(slot))
        return status

    def _call(self, slot: int, cmd: list[str], **kw: Any) -> int | None:
        self._rc[slot] = rc = self._children.call(cmd, **kw)
        return rc

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """submitit's hook at the end-of-job signal: stop every run after its round, then requeue this job."""
        from fedlight.lab.tables import jobs

        self._requeueing = True
        live = self._children.live()
        for p in live:
            p.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + STOP_WAIT_S
        for p in live:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # a long round: the previous checkpoint is kept
                p.kill()
        for run in self.runs:
            jobs.mark(run.path, state="pending", note=f"requeued after round {jobs.rounds_done(run.path)}")
        return submitit.helpers.DelayedSubmission(CellJob(**self.__getstate__()))


def _ignore_end_signal() -> None:
    """In a run's process before it starts: ignore submitit's end-of-job signal. Slurm's ``--signal`` reaches every
    process of the job step, and its default action would kill the run mid-round; the job stops its runs itself
    (:meth:`CellJob.checkpoint`)."""
    signal.signal(getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG), signal.SIG_IGN)


def submit(runs: list, res: Resources, out: Path, cluster: str, run_one: Callable, run_env: Callable) -> list:
    """Submit the unfinished runs, ``res.per_job()`` per job (a job array on Slurm), each job running its runs with
    ``run_one`` in ``run_env`` (see :class:`CellJob`); returns the submitit jobs."""
    from fedlight.lab.tables import jobs

    if cluster == "slurm" and not _which("sbatch"):
        raise ConfigError("`--launcher slurm` found no `sbatch` on PATH: run it on a Slurm login node (or rehearse "
                          "on this machine with `--cluster local`)")
    ex = submitit.AutoExecutor(folder=Path(out) / ".submitit", cluster=cluster, slurm_max_num_timeout=res.requeues,
                               local_max_num_timeout=res.requeues)
    ex.update_parameters(**executor_parameters(res))
    todo = groups(runs, res.per_job())
    for run in runs:
        jobs.mark(run.path, state="pending", job=None, launcher=cluster, note="submitted")
    with ex.batch():
        handles = [ex.submit(CellJob(g, res, run_one, run_env)) for g in todo]
    for handle, group in zip(handles, todo):
        for run in group:
            if jobs.read(run.path).get("state") == "pending":  # (a started job names itself)
                jobs.mark(run.path, job=handle.job_id)
    return handles


def wait(handles: list, cluster: str, poll_s: float = 2.0) -> None:
    """Wait until every job has ended: its result written, and on Slurm the job in a final state as Slurm shows it
    (so ``--status`` right after shows the end, not ``RUNNING``/``COMPLETING`` while the job's process exits), or a
    final state without a result (cancelled, failed, timed out; submitit alone waits for ever for such a job where
    Slurm keeps no accounting); a job Slurm no longer knows has ended when its result is written."""
    from fedlight.lab.tables import jobs

    def running(h) -> bool:
        if cluster != "slurm":
            return not h.done()
        v = _scontrol_view(h.job_id)
        return not h.done() if v is None else v.split()[0] in jobs.LIVE

    left = list(handles)
    while left:
        left = [h for h in left if running(h)]
        if left:
            time.sleep(poll_s)


def scheduler_state(out: Path) -> Callable[[str], str | None]:
    """``job_id -> Slurm's view of the job`` for ``--status``: its state (``PENDING``, ``RUNNING``, ``COMPLETED``,
    ``FAILED``, ``CANCELLED``, ``TIMEOUT``, ...), why it waits, and how often it was requeued, e.g. ``PENDING
    (BeginTime), requeued 1×``. ``scontrol`` knows the jobs slurmctld still holds, ``sacct`` (where accounting is on)
    older ones; ``None`` where neither can tell."""
    seen: dict[str, str | None] = {}

    def ask(job_id: str) -> str | None:
        if job_id not in seen:
            seen[job_id] = _scontrol_view(job_id) or _sacct_state(out, job_id)
        return seen[job_id]

    return ask


def _scontrol_view(job_id: str) -> str | None:
    try:
        text = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                              timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    info = dict(re.findall(r"(\w+)=(\S*)", text.splitlines()[0] if text.strip() else ""))
    if not info.get("JobState"):
        return None
    reason = f" ({info['Reason']})" if info.get("Reason") not in (None, "", "None") else ""
    restarts = int(info.get("Restarts") or 0)
    return info["JobState"] + reason + (f", requeued {restarts}×" if restarts else "")


def _sacct_state(out: Path, job_id: str) -> str | None:
    try:
        state = submitit.SlurmJob(Path(out) / ".submitit", job_id).state
    except Exception:  # noqa: BLE001 - no sacct, or an old job: the view falls back on job.json
        return None
    return None if state in (None, "UNKNOWN") else state


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None
