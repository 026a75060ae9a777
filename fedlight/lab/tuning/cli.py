"""``fedlight tune SPEC``: search each row's hyperparameters with Optuna on the same budget (the spec's ``tune:``
section, :mod:`fedlight.lab.tuning.space`), then ``fedlight reproduce SPEC --tuned OUT`` runs the table at the best
values.

Each trial is ordinary ``fedlight fit`` runs, one per seed, in ``OUT/<row>/trial<NNN>/seed<k>`` (resumable,
verifiable, tagged in the trackers with its study and trial), run by the job runner of ``fedlight reproduce``
(:mod:`fedlight.lab.tables.runner`: ``--jobs``, ``--per-gpu``, ``--launcher slurm``). The study is in Optuna's RDB
storage (:mod:`fedlight.lab.tuning.study`; default ``OUT/study.db``). While a trial runs, its evaluations are
reported to Optuna (step = seed index × rounds + round), and the run waits for the study's answer after each one
(:mod:`fedlight.run.study_gate`): when the pruner says so, the run stops after that round, its checkpoint written,
and the trial is told pruned, so which trials are pruned, and where, never depends on the machine's load. Stop the
command at any moment and run it again: finished trials stay, a trial whose worker is gone resumes its runs from
their checkpoints, the study continues.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fedlight.errors import check
from fedlight.lab.tables import report as rep
from fedlight.lab.tables import runner, studies
from fedlight.lab.tables.spec import Cell, base_path, cells, find_spec, load_spec, with_params
from fedlight.lab.tuning import space as tune_space
from fedlight.lab.tuning import study as tune_study
from fedlight.run import study_gate

BEAT_S = 30.0
"""How often a running trial's worker refreshes its ``beat`` in the storage."""


class Trial:
    """One Optuna trial as a unit of the job runner: its seeds' runs one after the other, its evaluations reported,
    stopped when pruned, then told to the study."""

    def __init__(self, job: Job, row: str, trial, runs: list[runner.Run]) -> None:
        self.job, self.row, self.trial, self.runs = job, row, trial, runs
        self.path = runs[0].path
        self.pruned, self.beat, self.answered = False, 0.0, 0
        self.reported = set(trial._cached_frozen_trial.intermediate_values)
        self.gated = job.tune.pruner["name"] != "none" and rep.curve_key(job.tune.objective) is not None

    @property
    def label(self) -> str:
        return f"{self.row} trial{self.trial.number}"

    def rounds(self) -> int:
        return sum(r.rounds() for r in self.runs)

    def execute(self, env: dict, call) -> str:
        import optuna

        for i, run in enumerate(self.runs):
            self.path = run.path
            wait_unlocked(run.path)  # a killed worker's run may still finish its round
            self.answered = 0
            gate = {}
            if self.gated and run.valid() and not run.finished():  # the run waits for the study after each report
                run.path.mkdir(parents=True, exist_ok=True)
                gate = study_gate.open_gate(run.path, rep.curve_key(self.job.tune.objective))
            status = runner.run_one(run, {**env, **gate}, call=lambda cmd, i=i, run=run, **kw: call(
                cmd, watch=lambda proc: self.watch(i, run, proc), **kw))
            if self.pruned:
                self.job.tell(self, None, optuna.trial.TrialState.PRUNED)
                return "pruned"
            if status in ("stopped", "not started"):  # by a signal: the trial resumes when the command reruns
                return status
            if status in ("failed", "conflict"):
                self.job.tell(self, None, optuna.trial.TrialState.FAIL)
                return status
            self.watch(i, run, None)  # evaluations written after the last look
        vals = [rep.metric_value(r.path, self.job.tune.objective) for r in self.runs]
        vals = [self.job.tune.rounds + 1 if v is None else v for v in vals]  # rounds_to_target not reached
        self.job.tell(self, statistics.fmean(vals), optuna.trial.TrialState.COMPLETE)
        return "done"

    def watch(self, i: int, run: runner.Run, proc) -> None:
        """Report the run's new evaluations; answer the last one (the run waits there): go on, or stop after it when
        the pruner says so (once pruned, every later answer is stop)."""
        tune, key = self.job.tune, rep.curve_key(self.job.tune.objective)
        if key is None:
            return
        rows = [r for r in rep.read_curve(run.path) if r.get(key) is not None]
        for j, row in enumerate(rows):
            step = i * tune.rounds + int(row["round"])
            if step not in self.reported:
                self.trial.report(self.job.intermediate(rows[:j + 1], key), step)
                self.reported.add(step)
        if time.time() - self.beat > BEAT_S:
            self.trial.set_user_attr(tune_study.WORKER, tune_study.mine())
            self.beat = time.time()
        last = int(rows[-1]["round"]) if rows else 0
        if proc is None or not self.gated or last <= self.answered:
            return
        self.pruned = self.pruned or (last < tune.rounds and self.trial.should_prune())
        self.answered = last
        study_gate.answer(run.path, last, self.pruned)


def wait_unlocked(path: Path, limit_s: float = 300.0) -> None:
    """Wait (bounded) until no process holds the run folder's lock."""
    import fcntl
    import os

    from fedlight.run.directory import LOCK_NAME

    lock, t0 = Path(path) / LOCK_NAME, time.time()
    while lock.is_file() and time.time() - t0 < limit_s:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        except OSError:
            time.sleep(0.5)
        finally:
            os.close(fd)


class Job:
    """One ``fedlight tune`` command: the studies of the rows and the trials it takes from them."""

    def __init__(self, spec: dict[str, Any], spec_path: Path, tune: tune_space.Tune, out: Path, storage: str,
                 name: str, rows: list[str], shrink: str | None, execution: list[str], create: bool = True) -> None:
        self.spec, self.spec_path, self.tune, self.out, self.name = spec, spec_path, tune, out, name
        self.shrink, self.execution, self.url = shrink, execution, storage
        self.storage = studies.open_storage(storage, create)
        self.maximize = tune.maximize(spec)
        self.cells = {c.row: c for c in cells(spec) if c.col == tune.column and c.row in rows}
        self.studies = {row: tune_study.open_study(
            self.storage, studies.study_name(name, row), tune.protocol(row, c.overrides, shrink, spec),
            self.maximize, tune_study.sampler(tune, row), tune_study.pruner(tune), create)
            for row, c in self.cells.items()}
        self.taken: dict[str, set[int]] = {row: set() for row in self.cells}
        self.lock = threading.Lock()

    def next(self) -> Trial | None:
        """The runner's source: the next trial, from the row with the fewest trials (rows stay level)."""
        order = sorted(self.studies, key=lambda r: len(self.studies[r].get_trials(deepcopy=False)))
        for row in order:
            trial = tune_study.claim(self.studies[row], self.tune.trials, self.tune.stale_after_s, self.taken[row])
            if trial is not None:
                self.taken[row].add(trial.number)
                return Trial(self, row, trial, self.trial_runs(row, trial))
        return None

    def trial_runs(self, row: str, trial) -> list[runner.Run]:
        c = self.cells[row]
        params = tune_study.suggest(trial, self.tune.space[row])
        cell = Cell(row, c.col, self.tune.objective, with_params({**c.overrides, "loop.rounds": self.tune.rounds},
                                                                 params), f"{row}/trial{trial.number:03d}")
        runs = runner.plan(self.spec, [cell], list(range(self.tune.seeds)), self.out, self.shrink, self.execution,
                           table=self.spec_path.stem)
        for r in runs:
            r.record["cell"].update(study=studies.study_name(self.name, row), trial=trial.number)
        return runs

    def intermediate(self, rows: list[dict[str, Any]], key: str) -> float:
        """The objective on the evaluations so far (accuracies in %, as the final value)."""
        from fedlight.run.files import is_fraction

        v = rep.from_curve(rows, self.tune.objective, key, {"metric_directions": {key: self.maximize}})
        return 100 * v if is_fraction(key) else v

    def tell(self, unit: Trial, value: float | None, state) -> None:
        with self.lock:
            try:
                self.studies[unit.row].tell(unit.trial.number, value, state=state if value is None else None,
                                            skip_if_finished=True)  # told already by a worker that took it too
            except RuntimeError as e:  # the grid sampler stops the study at its last point (the state is stored)
                if "Study.stop" not in str(e):
                    raise

    def left(self) -> int:
        return sum(max(0, self.tune.trials - len(s.get_trials(deepcopy=False))) for s in self.studies.values())


def default_out(spec_path: Path, shrink: str | None) -> Path:
    from fedlight.lab.tables.reproduce import default_out as table_out

    return Path("runs") / "tune" / table_out(spec_path, shrink).name


def cmd_tune(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fedlight tune", description="Search each row's hyperparameters with Optuna "
                                "(the spec's `tune:` section), trials as fedlight fit runs; write tune.md/tune.csv.")
    p.add_argument("spec", help="table spec YAML with a `tune:` section (or its name under recipes/tables/)")
    p.add_argument("--rows", default="*", help="glob(s) over the rows, comma-separated (default: all)")
    p.add_argument("--out", default=None, help="output folder (default runs/tune/<spec>[_shrink-...])")
    p.add_argument("--storage", default=None, help="Optuna storage, any SQLAlchemy URL (default sqlite:///OUT/study.db)")
    p.add_argument("--study", default=None, help="study name prefix; each row's study is <prefix>/<row> "
                   "(default: the spec's name)")
    p.add_argument("--shrink", default=None, help="e.g. subset=512,test_subset=256 (as fedlight reproduce)")
    p.add_argument("--jobs", type=int, default=1, help="trials in parallel (separate processes)")
    p.add_argument("--fit-args", default=None, help="`fedlight fit` flags that change how runs execute (as "
                   "fedlight reproduce)")
    p.add_argument("--report-only", action="store_true", help="run nothing; write tune.md/tune.csv from the storage")
    p.add_argument("--workers", type=int, default=1, help="with --launcher slurm: worker jobs that take trials from "
                   "the shared storage (give a --storage all of them reach, e.g. PostgreSQL)")
    runner.cluster_arguments(p)
    a = p.parse_args(argv)
    studies.need_optuna()
    spec_path = find_spec(a.spec)
    spec = load_spec(spec_path)
    where = f"table spec {spec_path}"
    check(base_path(spec).is_file(), f"{where}: base recipe {spec['base']} not found")
    tune = tune_space.parse(spec, where)
    rows = [r for r in spec["rows"] if any(fnmatch.fnmatchcase(r, g.strip()) for g in a.rows.split(","))]
    check(bool(rows) and a.jobs > 0 and a.workers > 0, f"`--rows {a.rows}` matches none of {', '.join(spec['rows'])}"
          if not rows else "`--jobs` and `--workers` must be positive")
    out = Path(a.out) if a.out else default_out(spec_path, a.shrink)
    name = a.study or spec_path.stem
    url = tune_study.storage_url(a.storage, out)
    with studies.storage_faults(url, out):
        return _tune(a, argv, spec, spec_path, tune, rows, out, name, url)


def _tune(a: argparse.Namespace, argv: list[str], spec: dict[str, Any], spec_path: Path, tune: tune_space.Tune,
          rows: list[str], out: Path, name: str, url: str) -> int:
    """The study: open it, run its trials, write its report (``fedlight tune``, once its arguments are checked)."""
    job = Job(spec, spec_path, tune, out, url, name, rows, a.shrink, runner.execution_args(a.fit_args),
              create=not a.report_only)  # --report-only: every study must exist; none is made or changed
    from fedlight.run.files import atomic_write_text

    if not a.report_only:
        atomic_write_text(out / "tune.json", json.dumps({"storage": url, "study": name, "spec": str(spec_path)})
                          + "\n")
    counts: dict[str, Any] = {}
    if a.report_only:
        pass
    elif a.launcher == "slurm":
        counts = runner.launch(a, spec, workers(a, spec, out, url), out)
    else:
        runner.check_local(a)
        print(f"fedlight tune: {len(rows)} row(s) × {tune.trials} trials of {tune.rounds} rounds × {tune.seeds} "
              f"seed(s); study {url} ({name}/<row>)", flush=True)
        counts = runner.run_local([], a.jobs, a.per_gpu, source=job.next, left=job.left())
    if counts.get("signal"):
        print(f"fedlight tune: stopped by {counts['signal']}; the runs stopped after a finished round; to continue, "
              f"run the same command again: {shlex.join(['fedlight', 'tune', *argv])}", file=sys.stderr, flush=True)
        return 128 + int(getattr(signal, counts["signal"]))
    from fedlight.lab.tuning import report as tune_report

    print(tune_report.write(job, shlex.join(["fedlight", "tune", *argv])))
    print(f"\nwrote {out / 'tune.md'} and {out / 'tune.csv'}")
    for row, items in tune_report.edges(job).items():
        print(f"fedlight tune: {row}: best at the edge of its space: {'; '.join(items)}; widen that range and tune "
              "again with a new --out (docs/tuning.md)", file=sys.stderr)
    return 1 if counts.get("failed") or counts.get("conflict") else 0


class Worker(runner.Run):
    """A ``fedlight tune`` process as a run of the Slurm launcher (``--launcher slurm``): it takes trials from the
    shared storage until there is none left to take. Not submitted (or, requeued, not started again) once
    ``OUT/tune.md`` says the budget is spent; done when its process exits 0, which it does when nothing is left to
    take, even while other workers still run their last trials (it then writes "not finished" in ``tune.md``: the
    worker that ends last writes "budget spent")."""

    def finished(self) -> bool:
        return (self.path.parent.parent / "tune.md").is_file() and "budget spent" in \
            (self.path.parent.parent / "tune.md").read_text()

    def outcome(self, rc: int) -> str:
        if runner.stopped_by_signal(rc):
            return "stopped"
        return "done" if rc == 0 else "failed"


def workers(a: argparse.Namespace, spec: dict[str, Any], out: Path, url: str) -> list[Worker]:
    check(not url.startswith("sqlite") or a.cluster == "local" or a.storage, "`--launcher slurm` with the default "
          "SQLite storage: give --storage a URL every node reaches (SQLite needs one shared file system)")
    base = ["tune", a.spec, "--out", str(out), "--storage", url, "--jobs", "1"]
    rest = [f"--rows={a.rows}", *([f"--shrink={a.shrink}"] if a.shrink else []), *([f"--study={a.study}"] if a.study
                                                                                       else []),
            *([f"--fit-args={a.fit_args}"] if a.fit_args else [])]
    cell = Cell("workers", "slurm", "", {}, "workers/slurm")
    return [Worker(cell, k, out / "workers" / f"w{k}", [*base, *rest], {"base": spec["base"], "flags": rest})
            for k in range(a.workers)]
