"""``fedlight tune``: a study of 4 tiny trials (quickstart, Synthetic data) with the median pruner, SIGKILLed while
its second trial runs; the same command finishes it. Checked from the storage and from the run directories: 4
trials, each finished or pruned once, the killed one resumed from its checkpoint (its rounds recorded once each),
each pruned one stopped after a round with its checkpoint. Then ``--tuned`` runs at the stored best values, a changed
spec is refused, optuna-dashboard serves the study, and every bad input is one line, exit 2, before any trial.

The CLI runs as a real process and each trial's run as a real process it starts, signals and loses when killed; to
keep the test small, each run's process is forked from the CLI's (``FORKED``: the same ``fedlight fit`` code
without importing torch again), not a fresh interpreter, and the second command runs in this process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

optuna = pytest.importorskip("optuna")

from fedlight.config.cli import main  # noqa: E402
from fedlight.lab.tables import runner  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 8
GRID = [0.3, 1e-6, 0.05, 1e-5]  # two useful and two useless step sizes: the pruner has something to stop
SPEC = {
    "title": "tiny tune", "base": "recipes/quickstart.yaml", "metric": "best_test_acc",
    "overrides": {"loop.local_steps": 20, "data.init_args.num_clients": 10, "loop.clients_per_round": 2},
    "rows": {"fedavg": {"algorithm": {"class_path": "fedlight.algorithms.FedAvg"}}},
    "tune": {"trials": 4, "rounds": ROUNDS, "objective": "best_test_acc", "sampler": {"name": "grid", "seed": 0},
             "pruner": {"name": "median", "n_startup_trials": 1, "n_warmup_steps": 2},
             "space": {"*": {"loop.lr": {"choices": GRID}}}},
}

# A `fedlight fit` process forked from the launcher's (torch, Lightning and fedlight already imported there).
FORKED = r'''
import os, signal, subprocess, sys, time, traceback
from fedlight.config.cli import main
from fedlight.run import stops
Real = subprocess.Popen

class Forked:
    def __init__(self, cmd, stdout=None, stderr=None, env=None, process_group=None, **kw):
        if cmd[1:3] != ["-m", "fedlight.config.cli"]:
            self.__class__ = Real
            Real.__init__(self, cmd, stdout=stdout, stderr=stderr, env=env, process_group=process_group, **kw)
            return
        self.args, self.returncode = cmd, None
        self.pid = os.fork()
        if self.pid == 0:
            rc = 1
            try:
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                    signal.signal(s, signal.SIG_DFL)
                os.setpgid(0, 0)
                os.dup2(stdout.fileno(), 1); os.dup2(stderr.fileno(), 2)
                os.environ.clear(); os.environ.update(env)
                stops.die_with_parent()
                rc = main(cmd[3:])
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush(); sys.stderr.flush(); os._exit(rc)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        t0 = time.time()
        while self.poll() is None:
            if timeout is not None and time.time() - t0 > timeout:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)
'''
# The CLI as its own process, its runs forked from it.
CLI = "import fedlight.config.api, lightning\n" + FORKED + "subprocess.Popen = Forked\nsys.exit(main(sys.argv[1:]))\n"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _cli(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLI, *args], cwd=cwd, env={**_env(), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _rows(run: Path) -> list[int]:
    return [json.loads(ln)["round"] for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _wait_for(what, limit_s: float, proc: subprocess.Popen | None = None) -> None:
    """Wait for ``what`` (a state the code under test reaches and holds: never a race); ``limit_s`` only bounds a
    hang."""
    t0 = time.time()
    while not what():
        assert time.time() - t0 < limit_s, "timed out"
        assert proc is None or proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The 4-trial study, SIGKILLed during its second trial and finished by the same command. The kill point is
    the fault hook's hold, not a moment: every trial's run holds in round 2 (round 1 recorded) until the test
    removes the file it creates; the first trial's hold is released, the second trial's is where the command is
    killed. A trial is never pruned before its round 2 (``n_warmup_steps: 2``), so it is running there, whatever
    the machine's load."""
    tmp = tmp_path_factory.mktemp("tune")
    (tmp / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    (tmp / "recipes").symlink_to(ROOT / "recipes")
    out, ready = tmp / "out", tmp / "ready"
    args = ["tune", "spec.yaml", "--out", "out"]
    proc = _cli(args, tmp, FEDLIGHT_FAULT="train@2:hold", FEDLIGHT_FAULT_READY=str(ready))
    first, second = (out / "fedavg" / f"trial00{k}" / "seed0" for k in (0, 1))
    try:
        _wait_for(lambda: ready.exists() and (first / "metrics.jsonl").is_file(), 600, proc)  # trial 0 holds
        ready.unlink()
        _wait_for(lambda: ready.exists() and (second / "metrics.jsonl").is_file(), 600, proc)  # trial 1 holds
        assert _rows(second) == [1]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    killed_at = len(_rows(second))
    storage = optuna.storages.RDBStorage(f"sqlite:///{out / 'study.db'}")
    before = optuna.load_study(study_name="spec/fedavg", storage=storage).get_trials()
    import lightning  # noqa: F401  (imported here once, not in each forked run)

    import fedlight.config.api  # noqa: F401

    forked: dict = {}
    exec(FORKED, forked)
    with pytest.MonkeyPatch.context() as here:  # the same command again, here (its runs forked from this process)
        here.chdir(tmp)
        here.setattr(subprocess, "Popen", forked["Forked"])
        assert main(args) == 0  # (a killed run stops after its round: the command waits for its folder's lock)
    after = optuna.load_study(study_name="spec/fedavg", storage=storage).get_trials()
    return {"tmp": tmp, "out": out, "before": before, "after": after, "killed_at": killed_at}


def test_a_killed_study_finishes_with_every_trial_run_once(study):
    states = optuna.trial.TrialState
    before, after, out = study["before"], study["after"], study["out"]
    assert [t.state for t in before] == [states.COMPLETE, states.RUNNING]  # killed in trial 1, held in round 2
    assert len(after) == 4 and sorted(t.number for t in after) == [0, 1, 2, 3]
    assert {t.state for t in after} <= {states.COMPLETE, states.PRUNED}
    assert sorted(t.params["loop.lr"] for t in after) == sorted(GRID)  # the grid, each point once
    assert sorted(p.name for p in (out / "fedavg").iterdir()) == ["trial000", "trial001", "trial002", "trial003"]
    for t in after:
        run = out / "fedavg" / f"trial{t.number:03d}" / "seed0"
        rounds = _rows(run)
        assert rounds == list(range(1, len(rounds) + 1))  # each round recorded once: resumed, never rerun
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["loop"]["lr"] == t.params["loop.lr"] and cfg["loop"]["rounds"] == ROUNDS
        made = json.loads((run / "reproduce.json").read_text())["cell"]
        assert (made["study"], made["trial"]) == ("spec/fedavg", t.number)  # the trackers' tags
        if t.state == states.COMPLETE:
            assert len(rounds) == ROUNDS and t.value == pytest.approx(max(r["test_acc"] for r in map(
                json.loads, (run / "metrics.jsonl").read_text().splitlines())) * 100)
        else:  # pruned: reported up to the decision and stopped right after it (the run waited for the study's
            # answer after each report, whatever the machine's load), its checkpoint written
            assert max(t.intermediate_values) == len(rounds) < ROUNDS
            assert json.loads((run / "job.json").read_text())["state"] == "stopped"
            assert (run / "checkpoints" / "last.ckpt").is_file()
    pruned = [t for t in after if t.state == states.PRUNED]  # the useless step sizes, after a useful one
    assert pruned and min(len(t.intermediate_values) for t in pruned) < ROUNDS
    resumed = out / "fedavg" / "trial001" / "seed0"
    assert "resum" in (resumed / "fit.log").read_text().lower() and study["killed_at"] >= 1
    text = (out / "tune.md").read_text()
    assert "budget spent" in text and "Importances" in text and (out / "tune_fedavg.png").stat().st_size > 1000
    best = max((t for t in after if t.state == states.COMPLETE), key=lambda t: t.value)
    assert f"| fedavg | {sum(t.state == states.COMPLETE for t in after)} | " in text and f"| {best.number} |" in text


def _tune_here(tmp: Path, out: str) -> list:
    """``fedlight tune`` of SMALL in this process (its runs forked from it); the study's trials."""
    import lightning  # noqa: F401  (imported here once, not in each forked run)

    import fedlight.config.api  # noqa: F401

    forked: dict = {}
    exec(FORKED, forked)
    with pytest.MonkeyPatch.context() as here:
        here.chdir(tmp)
        here.setattr(subprocess, "Popen", forked["Forked"])
        assert main(["tune", "small.yaml", "--out", out]) == 0
    return optuna.load_study(study_name="small/fedavg", storage=f"sqlite:///{tmp / out / 'study.db'}").get_trials()


SMALL = {**SPEC, "tune": {**SPEC["tune"], "rounds": 4, "pruner": {"name": "median", "n_startup_trials": 1,
                                                                    "n_warmup_steps": 1}}}


def test_a_study_decides_the_same_however_late_it_reads_its_runs(tmp_path, monkeypatch):
    """Pruning never depends on the machine's load: the same 4-trial study twice, once as it runs and once with the
    study reading each run only when the run can go no further (it has ended, or it has written an evaluated round
    before its last that the study has not answered yet: it waits there for the answer). That is a machine so busy
    that the study falls behind its runs by any number of rounds; before, its runs trained on meanwhile and every
    trial ended COMPLETE. Both studies have the same states, values, reported values and best trial, and a pruned
    trial's run stopped right after the round its decision was made at."""
    from fedlight.lab.tuning import cli as tune_cli
    from fedlight.run import study_gate

    (tmp_path / "small.yaml").write_text(yaml.safe_dump(SMALL))
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    idle = _tune_here(tmp_path, "idle")
    real = tune_cli.Trial.watch

    def blocked(run) -> bool:  # an evaluated round before its last written, not answered: the run waits there
        rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()] if (
            run.path / "metrics.jsonl").is_file() else []
        gate = study_gate._read(run.path / study_gate.NAME)
        return bool(rows) and gate is not None and rows[-1].get(gate["key"]) is not None and \
            gate["round"] < rows[-1]["round"] < SMALL["tune"]["rounds"]

    def late(self, i, run, proc):
        if proc is not None:
            _wait_for(lambda: proc.poll() is not None or blocked(run), 600)
        real(self, i, run, proc)

    monkeypatch.setattr(tune_cli.Trial, "watch", late)
    busy = _tune_here(tmp_path, "busy")
    states = optuna.trial.TrialState
    assert any(t.state == states.PRUNED for t in idle) and any(t.state == states.COMPLETE for t in idle)
    for a, b in zip(idle, busy):
        assert (a.number, a.state, a.value, a.params, a.intermediate_values) == \
            (b.number, b.state, b.value, b.params, b.intermediate_values)
        if a.state == states.PRUNED:
            for out in ("idle", "busy"):
                assert _rows(tmp_path / out / "fedavg" / f"trial{a.number:03d}" / "seed0") == list(
                    range(1, max(a.intermediate_values) + 1))
    best = [max((t for t in s if t.state == states.COMPLETE), key=lambda t: t.value).number for s in (idle, busy)]
    assert best[0] == best[1]


def test_reproduce_tuned_runs_at_the_best_values(study, monkeypatch, capsys):
    monkeypatch.chdir(study["tmp"])
    monkeypatch.setattr(runner.Children, "call", lambda self, cmd, stdout, stderr, env: main(cmd[3:]))
    assert main(["reproduce", "spec.yaml", "--tuned", "out", "--shrink", "rounds=1", "--out", "tuned"]) == 0
    best = max((t for t in study["after"] if t.state == optuna.trial.TrialState.COMPLETE), key=lambda t: t.value)
    cfg = yaml.safe_load((study["tmp"] / "tuned" / "fedavg" / "result" / "seed0" / "config.yaml").read_text())
    assert cfg["loop"]["lr"] == best.params["loop.lr"]
    assert f"loop.lr = {best.params['loop.lr']:.4g}" in (study["tmp"] / "tuned" / "table.md").read_text()


def test_a_changed_spec_is_refused_naming_the_difference(study, monkeypatch, capsys):
    monkeypatch.chdir(study["tmp"])
    changed = {**SPEC, "tune": {**SPEC["tune"], "space": {"*": {"loop.lr": {"choices": [0.1, 0.2]}}}}}
    Path("changed.yaml").write_text(yaml.safe_dump(changed))
    assert main(["tune", "changed.yaml", "--out", "out", "--study", "spec"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "`space` is" in err and "0.2" in err


def test_optuna_dashboard_serves_the_study(study):
    exe = Path(sys.executable).with_name("optuna-dashboard")
    if not exe.is_file():
        pytest.skip("optuna-dashboard is not installed (pip install 'fedlight[tune]')")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(exe), f"sqlite:///{study['out'] / 'study.db'}", "--host", "127.0.0.1", "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        studies, deadline = None, time.monotonic() + 600  # a bound on a hang: it answers once it has started
        while studies is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=60) as r:
                    studies = json.loads(r.read())["study_summaries"]
            except OSError:
                assert proc.poll() is None, "optuna-dashboard exited"
                time.sleep(0.5)
        assert studies is not None, "optuna-dashboard did not answer in 600 s"
        (ours,) = [s for s in studies if s["study_name"] == "spec/fedavg"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/{ours['study_id']}", timeout=60) as r:
            detail = json.loads(r.read())
        assert len(detail["trials"]) == 4
        assert {t["state"] for t in detail["trials"]} <= {"Complete", "Pruned"}
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _tune_with(tmp_path, monkeypatch, capsys, change, extra=()):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    spec = json.loads(json.dumps(SPEC))
    change(spec)
    Path("bad.yaml").write_text(yaml.safe_dump(spec))
    called = []
    monkeypatch.setattr(runner.Children, "call", lambda *a, **k: called.append(a))
    code = main(["tune", "bad.yaml", "--out", "out", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and not called, err
    return err


@pytest.mark.parametrize("change, extra, says", [
    (lambda s: s["tune"]["space"].update({"*": {"loop.lrr": {"low": 0.01, "high": 0.1}}}), (),
     "no such setting; did you mean 'loop.lr'?"),
    (lambda s: s["tune"]["space"].update({"*": {"loop.lr_schedule": {"low": 0.01, "high": 0.1}}}), (),
     "a range needs a numeric setting"),
    (lambda s: s["tune"]["space"].update({"fedavg": {"algorithm.init_args.server_lrr": {"low": 0.5, "high": 1}}}),
     (), "did you mean 'algorithm.init_args.server_lr'?"),
    (lambda s: s["tune"].update(space={}), (), "`tune.space` is empty"),
    (lambda s: s["tune"].update(objective="best_test_mse"), (), "does not report"),
    (lambda s: None, ("--storage", "sqlite:////proc/no/study.db"), "cannot be opened"),
    (lambda s: None, ("--storage", "nosuchdb://x"), "cannot be opened"),
])
def test_bad_input_is_one_line_before_any_trial(tmp_path, monkeypatch, capsys, change, extra, says):
    assert says in _tune_with(tmp_path, monkeypatch, capsys, change, extra)


# ------------------------------------------------------------------------------------------------ restarts, recipes,
# read-only commands (issue 60): the studies alone, no trial run
def _job(tmp: Path, spec: dict, create: bool = True):
    from fedlight.lab.tables.spec import load_spec
    from fedlight.lab.tuning import cli as tune_cmd
    from fedlight.lab.tuning import space as tune_space

    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_spec(path)
    tune = tune_space.parse(loaded, "spec")
    return tune_cmd.Job(loaded, path, tune, tmp / "out", f"sqlite:///{tmp / 'out' / 'study.db'}", "spec",
                        ["fedavg"], None, [], **({} if create else {"create": False}))


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    return tmp_path


RANDOM = {**SPEC, "tune": {**SPEC["tune"], "trials": 3, "sampler": {"name": "random", "seed": 0},
                           "pruner": "none", "space": {"*": {"loop.lr": {"low": 0.001, "high": 0.3, "log": True}}}}}


def _lrs(tmp: Path, restart: bool) -> list[float]:
    job, lrs = None, []
    for k in range(3):
        job = _job(tmp, RANDOM) if restart or job is None else job  # a restart: a new process, its sampler afresh
        trial = job.next()
        lrs.append(trial.trial.params["loop.lr"])
        job.tell(trial, float(k), optuna.trial.TrialState.COMPLETE)
    return lrs


def test_a_restarted_study_draws_what_an_uninterrupted_one_draws(tmp_path, monkeypatch):
    """A restart re-seeded the sampler: its first trial repeated trial 0's values (a run repeated bit for bit)."""
    runs = []
    for restart in (False, True):
        tmp = tmp_path / str(restart)
        tmp.mkdir()
        monkeypatch.chdir(tmp)
        (tmp / "recipes").symlink_to(ROOT / "recipes")
        runs.append(_lrs(tmp, restart))
    assert len(set(runs[1])) == 3 and runs[1] == runs[0]


def test_an_edited_base_recipe_is_refused_naming_the_setting(here):
    from fedlight.errors import ConfigError

    _job(here, SPEC)
    base = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    base["loop"]["weight_decay"] = 0.001
    (here / "base.yaml").write_text(yaml.safe_dump(base))
    with pytest.raises(ConfigError, match=r"`recipe.loop.weight_decay` is 0.0 in the study and 0.001 now"):
        _job(here, {**SPEC, "base": "base.yaml"})
    _job(here, {**SPEC, "tune": {**SPEC["tune"], "trials": 5}})  # the same recipe: the budget may grow


def test_report_only_writes_nothing_and_refuses_an_unknown_study(here, capsys):
    (here / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    assert main(["tune", "spec.yaml", "--out", "out", "--report-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no study storage there" in err and not (here / "out").exists(), err
    _job(here, SPEC)  # a study of spec.yaml, then its report under another file name of the same spec
    (here / "same.yaml").write_text(yaml.safe_dump(SPEC))
    before = {p.name: p.read_bytes() for p in (here / "out").iterdir()}
    assert main(["tune", "same.yaml", "--out", "out", "--report-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the storage has no study 'same/fedavg' (it has spec/fedavg)" in err, err
    assert {p.name: p.read_bytes() for p in (here / "out").iterdir()} == before
    assert optuna.get_all_study_names(f"sqlite:///{here / 'out' / 'study.db'}") == ["spec/fedavg"]
    assert main(["reproduce", "spec.yaml", "--tuned", f"sqlite:///{here / 'none.db'}", "--dry-run"]) == 2
    assert "no study storage there" in capsys.readouterr().err and not (here / "none.db").exists()


@pytest.fixture
def zombie():
    """A process of this host that has ended and is not reaped yet (what a killed Slurm job's orphaned worker stays
    where no process reaps orphans); reaped at the end."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
    yield pid
    os.waitpid(pid, 0)


def test_a_worker_that_ended_or_whose_id_was_reused_is_gone(zombie):
    from fedlight.lab.tuning import study as tune_study

    me = tune_study.mine()
    assert not tune_study.gone(me, 3600)
    assert tune_study.gone({**me, "pid": zombie}, 3600)  # its process ended (os.kill(pid, 0) still succeeds)
    assert tune_study.gone({**me, "start": me["start"] - 1}, 3600)  # the id is now another process's (this one)
    parent = {**me, "pid": os.getppid(), "start": None}
    assert not tune_study.gone(parent, 3600) and tune_study.gone({**parent, "beat": time.time() - 7200}, 3600)


def test_a_trial_whose_requeued_worker_ended_unreaped_is_resumed_by_another(here, zombie):
    """tests/test_tune_slurm.py's requeue left a trial RUNNING: the requeued job's worker, orphaned when Slurm ended
    the job, stayed a zombie (this machine's first process reaps no orphans), so it counted as alive, no worker took
    its trial over, and both workers ended with the budget spent."""
    from fedlight.lab.tuning import study as tune_study

    one = {**SPEC, "tune": {**SPEC["tune"], "trials": 1}}
    taken = _job(here, one).next()
    taken.trial.set_user_attr(tune_study.WORKER, {**tune_study.mine(), "pid": zombie, "start": None})
    again = _job(here, one).next()  # another worker's process
    assert again is not None and again.trial.number == 0 and again.path == taken.path


def test_two_workers_looking_at_once_never_take_one_trial(tmp_path, monkeypatch):
    """The race CI met with two Slurm workers starting together: a trial another worker has just asked for (not yet
    marked) is not taken before the grace ends, and of two workers that mark a gone trial at once only the last
    takes it (the other goes on to a new trial)."""
    from fedlight.lab.tuning import study as tune_study

    monkeypatch.setattr(tune_study, "CLAIM_SETTLE_S", 0.0)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="s")
    fresh = study.ask()  # another worker's, between ask() and marking it
    got = tune_study.claim(study, budget=4, stale_after_s=3600, taken=set())
    assert got.number != fresh.number and got.user_attrs[tune_study.WORKER]["pid"] == os.getpid()
    monkeypatch.setattr(tune_study, "UNMARKED_GRACE_S", 0.0)  # later: a worker that died before marking it
    assert tune_study.claim(study, budget=4, stale_after_s=3600, taken={got.number}).number == fresh.number

    gone_one = study.ask()
    gone_one.set_user_attr(tune_study.WORKER, {"host": "elsewhere", "pid": 1, "start": 0, "beat": 0})
    rival = {"host": "elsewhere", "pid": 2, "start": 0, "beat": time.time()}
    real_sleep = tune_study.time.sleep

    def the_other_marks_meanwhile(s):  # the other worker's mark lands after this one's
        study._storage.set_trial_user_attr(gone_one._trial_id, tune_study.WORKER, rival)
        real_sleep(s)

    monkeypatch.setattr(tune_study.time, "sleep", the_other_marks_meanwhile)
    taken = {got.number, fresh.number}
    mine = tune_study.claim(study, budget=5, stale_after_s=3600, taken=taken)
    assert mine.number not in (gone_one.number, *taken)  # lost the mark: a new trial instead
    assert study._storage.get_trial(gone_one._trial_id).user_attrs[tune_study.WORKER] == rival
