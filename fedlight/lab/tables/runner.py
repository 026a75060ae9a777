"""The one job runner of ``fedlight reproduce`` and ``fedlight tune``: each run is the subprocess ``python -m
fedlight.config.cli fit --config BASE <overrides> --seed k --out_dir RUN --resume auto``, so finished runs are
skipped, interrupted ones resume, and ``reproduce.json`` keeps another command from reusing a run folder.

Launchers: ``--launcher local`` (default) runs the processes here, ``--jobs`` at a time (or ``--per-gpu N`` per
visible GPU); ``--launcher slurm`` submits them as Slurm jobs through submitit (:mod:`fedlight.lab.tables.slurm`),
requeued with ``--resume auto`` on preemption or time-out. Either way each run folder keeps ``fit.log`` and
``job.json``, and ``--status`` shows where every run stands (:mod:`fedlight.lab.tables.jobs`). The local pool takes a
list of runs or a source that makes them as it goes (``fedlight tune`` asks Optuna for the next trial when a slot is
free).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fedlight
from fedlight.errors import ConfigError, check
from fedlight.lab.tables import gpu_share
from fedlight.lab.tables import report as rep
from fedlight.lab.tables.jobs import Children
from fedlight.lab.tables.spec import Cell, base_path, flags, shrink_overrides

IDENTITY = ("base", "flags")
"""The keys of a run's ``reproduce.json`` that say what experiment it is (``execution`` may differ on resume)."""

EXECUTION_FLAGS = ("--loop.client_parallelism", "--loop.vmap_chunk", "--loop.channels_last", "--loop.matmul_convs",
                   "--loop.compile", "--loop.state_budget_mb", "--loop.state_device", "--loop.save_every",
                   "--loop.progress", "--devices", "--num_nodes", "--accelerator", "--loggers")
"""``fedlight fit`` flags that change how a run executes, not what it computes (up to floating-point order)."""


def execution_args(text: str | None) -> list[str]:
    """Parse ``--fit-args``; only :data:`EXECUTION_FLAGS` are allowed (they do not change a cell's experiment)."""
    args = shlex.split(text or "")
    for a in args:
        if a.split("=", 1)[0] in ("--streams", "--seeds"):  # not fit's: a group's (reproduce makes its groups)
            raise ConfigError(f"`--fit-args`: {a.split('=', 1)[0]} is a `fedlight lockstep` flag, not a `fedlight fit` "
                              "one; reproduce chooses each group's seeds, and its groups take --streams from "
                              "$FEDLIGHT_LOCKSTEP_STREAMS (auto, on or off)")
        if a.startswith("--") and a.split("=", 1)[0] not in EXECUTION_FLAGS:
            raise ConfigError(f"`--fit-args`: {a.split('=', 1)[0]} changes the experiment, not how it runs; put it in "
                              f"the table spec (or use --shrink). Allowed: {', '.join(EXECUTION_FLAGS)}")
    return args


@dataclass
class Run:
    cell: Cell
    seed: int
    path: Path  # OUT/<run_key>/seed<k>
    argv: list[str]  # `fedlight fit ...` arguments
    record: dict[str, Any]  # what made the run (kept in reproduce.json; another command must not reuse the folder)

    def valid(self) -> bool:
        mark = self.path / "reproduce.json"
        if not mark.is_file():
            return True
        made = json.loads(mark.read_text())
        return {k: made.get(k) for k in IDENTITY} == {k: self.record.get(k) for k in IDENTITY}

    def finished(self) -> bool:
        return rep.finished(self.path)

    def done(self) -> bool:
        return self.valid() and self.finished()

    @property
    def label(self) -> str:
        return f"{self.cell.run_key} seed{self.seed}"

    def rounds(self) -> int:
        return gpu_share.rounds_in(self.path)

    def outcome(self, rc: int) -> str:
        """What its finished process left (:func:`outcome`)."""
        return outcome(self, rc)

    def execute(self, env: dict, call) -> str:
        """Run it in the local pool (``call``: :meth:`fedlight.lab.tables.jobs.Children.call`)."""
        return run_one(self, env, call=call)


def plan(spec, cs: list[Cell], seeds: list[int], out: Path, shrink: str | None,
         execution: list[str] | None = None, table: str | None = None) -> list[Run]:
    runs = []
    for c in cs:
        fl = flags({**c.overrides, **shrink_overrides(shrink, spec, c)})
        for k in seeds:
            path = out / c.run_key / f"seed{k}"
            argv = ["fit", "--config", str(base_path(spec)), *fl, "--seed", str(k), "--out_dir", str(path),
                    "--resume", "auto", *(execution or [])]
            runs.append(Run(c, k, path, argv, {"base": spec["base"], "flags": [*fl, "--seed", str(k)],
                                               "execution": list(execution or []),  # cell: tags of its trackers
                                               "cell": {"table": table, "row": c.row, "column": c.col, "seed": k}}))
    return runs


def run_one(run: Run, env: dict, call=None, mark: bool = True) -> str:
    """Run (or resume, or skip) one seed of one cell: 'done', 'diverged', 'skipped', 'failed', 'stopped' (by a
    signal, after a round: resumable) or 'conflict'. ``call`` runs the command (default ``subprocess.call``; it
    returns ``None`` when a stop came first and the command did not start); ``mark``: record the run's state in its
    ``job.json`` (for ``--status``)."""
    from fedlight.lab.tables import jobs
    from fedlight.run.files import atomic_write_text

    if not run.valid():
        return "conflict"
    if run.finished():
        return "skipped"
    run.path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run.path / "reproduce.json", json.dumps(run.record, indent=1) + "\n")
    if mark:
        jobs.mark(run.path, state="running", pid=os.getpid(), host=jobs.host())
    with open(run.path / "fit.log", "a") as log:
        rc = (call or subprocess.call)([sys.executable, "-m", "fedlight.config.cli", *run.argv], stdout=log, stderr=log,
                                       env=env)
    status = run.outcome(rc) if rc is not None else "stopped"
    if mark:
        jobs.mark(run.path, state=status, rc=rc)
    return status


def stopped_by_signal(rc: int) -> bool:
    """Whether a process's exit status says a stop signal ended it after a round (exit 128 + signal)."""
    from fedlight.run.stops import STOP_SIGNALS

    return rc in {128 + int(getattr(signal, name)) for name in STOP_SIGNALS}


def outcome(run: Run, rc: int) -> str:
    """What a finished ``fedlight fit`` process left: done, diverged, stopped (exit 128 + signal) or failed."""
    diverged = run.finished() and (rep.read_summary(run.path) or {}).get("diverged_at_round") is not None
    if stopped_by_signal(rc) and not run.finished():
        return "stopped"
    if not run.finished() or (rc != 0 and not diverged):
        return "failed"
    return "diverged" if diverged else "done"


def run_env(jobs: int) -> dict[str, str]:
    """The environment of the ``fedlight fit`` processes: this fedlight first on the path, CPU threads shared; each
    stops (``SIGTERM``) if this process dies (:func:`fedlight.run.stops.die_with_parent`)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(fedlight.__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH")])),
               FEDLIGHT_PARENT_PID=str(os.getpid()))
    if jobs > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


def run_local(runs: list[Run], jobs: int, per_gpu: str | None, source=None, left: int = 0) -> dict[str, int]:
    """The local pool: ``jobs`` processes, or ``--per-gpu N|auto`` runs sharing each visible GPU (threads split,
    caches shared, memory bounded: :mod:`fedlight.lab.tables.gpu_share`); says how many share a GPU and why. ``source``
    (see :func:`run_all`) makes the runs as it goes, ``left`` of them at most."""
    want = gpu_share.parse_per_gpu(per_gpu)
    if want is None:
        return run_all(runs, jobs, source=source)
    import torch

    ngpu = torch.cuda.device_count()
    gpu_slots(1, ngpu)  # refuses a machine without a GPU
    left = left or len({r.path for r in runs if r.valid() and not r.finished()})
    gib = min(torch.cuda.get_device_properties(g).total_memory for g in range(ngpu)) / 2**30 if want == "auto" else 0
    n, why = gpu_share.choose(want, left, max(1, gpu_share.cpu_cores() // ngpu), gib)
    env, shared = gpu_share.share_env(run_env(n * ngpu), n)
    print(f"fedlight: {n} run(s) at a time on each of {ngpu} GPU(s) ({why}); {shared}; the first run "
          "starts alone and the others once it has finished a round, so that only it compiles and decodes", flush=True)
    return run_all(runs, jobs, gpu_slots(n, ngpu), env=env, stagger=n * ngpu > 1 and source is None, source=source)


def gpu_slots(per_gpu: int | None, num_gpus: int) -> list[str] | None:
    """``--per-gpu N`` with the local launcher: N slots per visible GPU (``CUDA_VISIBLE_DEVICES`` of each run)."""
    if not per_gpu:
        return None
    check(num_gpus > 0, "`--per-gpu` packs runs onto GPUs, but this machine shows none; use `--jobs N` for CPU "
          "processes")
    return [str(g) for g in range(num_gpus) for _ in range(per_gpu)]


def run_all(runs: list[Run], jobs: int, slots: list[str] | None = None, env: dict[str, str] | None = None,
            stagger: bool = False, source=None) -> dict[str, int]:
    """Run each distinct run folder once, ``jobs`` processes at a time (one per GPU slot with ``slots``), seed 0 of
    every cell first; print one line per run, then the table's throughput (rounds per second of all runs).
    ``stagger``: the first run to do starts alone, the others once it has finished a round (shared caches).
    ``source``: instead of ``runs``, a function a free worker calls (one at a time) for its next unit of work, None
    when there is none; a unit has what :class:`Run` has for this: ``label``, ``path``, ``execute`` and ``rounds``."""
    import queue

    # Columns that differ only in their metric share runs; seed 0 of every cell first (a whole table soonest).
    todo = sorted({r.path: r for r in runs}.values(), key=lambda r: r.seed)
    jobs = len(slots) if slots else jobs
    env = env or run_env(jobs)
    free: queue.Queue = queue.Queue()
    for slot in slots or []:
        free.put(slot)
    lock, counts, t0, children, rounds = threading.Lock(), {}, time.time(), Children(), [0]
    lead = next((r for r in todo if r.valid() and not r.finished()), None) if stagger else None
    first = gpu_share.FirstRun(lead.path) if lead else None
    total = f"/{sum(len(getattr(r, 'runs', [r])) for r in todo)}" if source is None else ""  # groups: their runs

    def go(run) -> None:
        t, before = time.time(), run.rounds()
        if first is not None and run is not lead:
            first.wait(lambda: bool(children.signal))
        slot = free.get() if slots else None
        try:
            if children.signal:  # stopping: start nothing new
                status = "not started"
            else:
                status = run.execute(env if slot is None else {**env, "CUDA_VISIBLE_DEVICES": slot}, children.call)
        finally:
            if slot is not None:
                free.put(slot)
            if run is lead:
                first.ended = True
        with lock:
            rounds[0] += max(0, run.rounds() - before)
            for one, st in (status if isinstance(status, list) else [(run, status)]):  # a lockstep group: its runs'
                counts[st] = counts.get(st, 0) + 1
                hint = {"failed": f" — see {one.path / 'fit.log'}", "conflict": f" — {one.path} was made by another "
                        "command (reproduce.json); delete it or pass another --out",
                        "stopped": " — by a signal, after a round; the same command resumes it"}.get(st, "")
                if st == "failed":
                    hint += gpu_share.memory_hint(one.path / "fit.log", env.get(gpu_share.FRACTION_ENV))
                print(f"[{sum(counts.values())}{total}] {one.label}: {st} ({time.time() - t:.0f} s){hint}", flush=True)

    items = iter(todo)
    take, errors = threading.Lock(), []

    def worker() -> None:
        try:
            while True:
                with take:
                    unit = next(items, None) if source is None else (None if children.signal else source())
                if unit is None:
                    return
                go(unit)
        except BaseException as e:  # noqa: BLE001 - raised again by the caller's thread, below
            errors.append(e)

    with children.forwarding():
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(jobs)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    if errors:
        raise errors[0]
    wall = time.time() - t0
    print(f"{sum(counts.values())} runs in {wall:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f"; {rounds[0]} rounds, {rounds[0] / max(wall, 1e-9):.2f} rounds/s of the table ({jobs} at a time)",
          flush=True)
    if children.signal:
        counts["signal"] = children.signal
    return counts


# ------------------------------------------------------------------------------------------------ launchers
CLUSTER_FLAGS = ("partition", "time", "gpus", "cpus", "mem", "account", "sbatch", "per_gpu", "requeues")


def cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launchers", "where the runs execute; Slurm resources may also come from the spec's "
                             "`slurm:` mapping (flags win)")
    g.add_argument("--launcher", choices=("local", "slurm"), default="local", help="local: a process pool on this "
                   "machine (--jobs); slurm: one job per run, or per --per-gpu group, through submitit "
                   "(pip install 'fedlight[slurm]'), requeued with --resume auto on preemption or time-out")
    g.add_argument("--cluster", choices=("slurm", "local"), default="slurm", help="with --launcher slurm: submit "
                   "with sbatch (slurm), or rehearse with submitit's local executor, jobs as processes here (local)")
    g.add_argument("--per-gpu", default=None, metavar="N|auto", help="runs side by side per GPU: local launcher: N "
                   "processes per visible GPU (auto: as many as the runs to do, CPU cores and GPU memory allow; "
                   "threads split, compile and data caches shared, memory bounded, the choice printed); slurm: N "
                   "runs per GPU of each job (per job without --gpus)")
    g.add_argument("--partition", help="Slurm partition")
    g.add_argument("--time", help="time limit per job, as sbatch takes it: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM "
                   "or D-HH:MM:SS (default 4:00:00); a job that reaches it is requeued and its runs resume")
    g.add_argument("--gpus", type=int, metavar="G", help="GPUs per job (default 0)")
    g.add_argument("--cpus", type=int, help="CPUs per job")
    g.add_argument("--mem", help="memory per job: GB as a plain number (64), or with sbatch's unit (64G, 4000M)")
    g.add_argument("--account", help="Slurm account")
    g.add_argument("--sbatch", action="append", metavar="KEY[=VALUE]", help="a further sbatch option, passed "
                   "unchanged, e.g. --sbatch qos=high --sbatch constraint=a100 --sbatch exclusive (repeatable)")
    g.add_argument("--requeues", type=int, help="time-outs a job may be requeued after (default 10; preemptions "
                   "are not counted)")
    g.add_argument("--wait", action="store_true", help="with --launcher slurm: wait for the jobs, then write the "
                   "table (default: submit, print the job ids and write the table of what has finished)")


def slurm_flags(a: argparse.Namespace) -> dict[str, Any]:
    flags = {k: getattr(a, k) for k in CLUSTER_FLAGS}
    check(a.per_gpu != "auto", "`--per-gpu auto` packs runs onto this machine's GPUs (local launcher); give Slurm "
          "a number, e.g. --per-gpu 8")
    flags["per_gpu"] = gpu_share.parse_per_gpu(a.per_gpu)
    if a.sbatch:  # KEY=VALUE, or a bare KEY for sbatch's options without a value (--sbatch exclusive)
        pairs = [o.lstrip("-").partition("=") for o in a.sbatch]
        check(all(k for k, _, _ in pairs), f"`--sbatch` takes KEY=VALUE or KEY, got {a.sbatch!r}")
        flags["sbatch"] = {k: v if eq else True for k, eq, v in pairs}
    return flags


def check_local(a: argparse.Namespace) -> None:
    slurm_only = [k for k in CLUSTER_FLAGS if k != "per_gpu" and getattr(a, k) is not None]
    check(a.cluster == "slurm" and not slurm_only and not a.wait,
          "`--cluster`, `--wait` and the Slurm resource flags need `--launcher slurm`")


def launch(a: argparse.Namespace, spec: dict[str, Any], runs: list[Run], out: Path) -> dict[str, int]:
    """Run (local) or submit (slurm) the chosen runs; the counts of their outcomes (empty after a submission)."""
    if a.launcher == "local":
        check_local(a)
        return run_local(runs, a.jobs, a.per_gpu)
    from fedlight.lab.tables import slurm

    res = slurm.resources(spec, slurm_flags(a))
    distinct = list({r.path: r for r in runs}.values())
    for r in distinct:
        if not r.valid():
            print(f"{r.cell.run_key} seed{r.seed}: conflict — {r.path} was made by another command (reproduce.json); "
                  "delete it or pass another --out", flush=True)
    todo = [r for r in distinct if r.valid() and not r.finished()]
    handles = slurm.submit(todo, res, out, a.cluster, run_one, run_env) if todo else []
    print(f"submitted {len(todo)} runs in {len(handles)} jobs ({', '.join(h.job_id for h in handles) or '-'}); "
          f"see them with: fedlight reproduce {a.spec} --status" + (f" --out {a.out}" if a.out else ""), flush=True)
    if not a.wait:
        return {}
    slurm.wait(handles, a.cluster)
    from fedlight.lab.tables import jobs

    counts: dict[str, int] = {}
    for r in todo:  # what the jobs left: a run stopped (scancel) or failed makes the command fail
        st = jobs.read(r.path).get("state")
        st = st if st in ("done", "diverged", "skipped", "failed") else "stopped"  # a job cancelled before it ran
        counts[st] = counts.get(st, 0) + 1
    return counts


def status(a: argparse.Namespace, out: Path, runs: list[Run]) -> int:
    from fedlight.lab.tables import jobs

    scheduler = None
    if any(jobs.read(r.path).get("launcher") == "slurm" for r in runs):  # submitted with sbatch: sacct knows more
        from fedlight.lab.tables import slurm

        scheduler = slurm.scheduler_state(out)
    print(jobs.status_table(runs, scheduler))
    return 0
