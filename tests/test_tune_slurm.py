"""``fedlight tune --launcher slurm --workers 2`` on the real single-node Slurm (the ``slurm_cluster`` fixture): two
worker jobs share one SQLite study (one node: one file system) and take its 4 trials between them; one worker job is
requeued (``scontrol requeue``) while its trial holds in round 2. Its trial stops after that round and is resumed
from its checkpoint by the next worker that finds the trial's worker gone; every trial runs exactly once, each round
recorded once, both jobs end COMPLETED, and ``tune.md`` says the budget is spent. Skipped, with the reason, where no
Slurm can be started."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml
from test_reproduce_real_slurm import on_slurm  # noqa: F401  (the fixture)
from test_tune import ROUNDS, SPEC, _rows

from fedlight.config.cli import main
from fedlight.lab.tuning import study as tune_study

optuna = pytest.importorskip("optuna")
pytest.importorskip("submitit")


def _slurm_job_of(pid: int) -> str | None:
    """The Slurm job a process of this node belongs to (its environment says), or None once it is gone."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"SLURM_JOB_ID=")), None)


def _trials(url: str) -> list:
    return optuna.load_study(study_name="spec/fedavg", storage=url).get_trials()


def test_two_slurm_workers_share_a_study_and_a_requeued_workers_trial_resumes(on_slurm, tmp_path,  # noqa: F811
                                                                               monkeypatch, capsys):
    spec, out, ready = tmp_path / "spec.yaml", tmp_path / "out", tmp_path / "ready"
    spec.write_text(yaml.safe_dump(SPEC))
    url = f"sqlite:///{tmp_path / 'study.db'}"
    args = ["tune", str(spec), "--out", str(out), "--storage", url, "--launcher", "slurm", "--workers", "2",
            "--partition", "debug", "--cpus", "1", "--mem", "2G"]
    with monkeypatch.context() as held:  # the jobs' environment only: each trial's run holds in round 2 (<= 300 s)
        held.setenv("FEDLIGHT_FAULT", "train@2:hold")  # until the test removes the file it creates
        held.setenv("FEDLIGHT_FAULT_READY", str(ready))
        assert main(args) == 0
    assert "submitted 2 runs in 2 jobs" in capsys.readouterr().out

    def workers() -> list[str]:  # the jobs' Slurm ids, as each started job records its own (array tasks have theirs)
        return [str(json.loads((out / "workers" / f"w{k}" / "job.json").read_text())["job"]) for k in (0, 1)]

    def holding():  # a running trial whose run holds in round 2 (round 1 recorded), and its worker's Slurm job
        for t in _trials(url):
            run = out / "fedavg" / f"trial{t.number:03d}" / "seed0"
            w = t.user_attrs.get(tune_study.WORKER) or {}
            if t.state == optuna.trial.TrialState.RUNNING and (run / "metrics.jsonl").is_file() and \
                    _rows(run) == [1] and _slurm_job_of(w.get("pid", -1)) in workers():
                return t, w, _slurm_job_of(w["pid"])
        return None

    on_slurm.wait_for(lambda: ready.exists() and holding(), "a trial's run to hold in round 2")
    trial, worker, job = holding()
    run = out / "fedavg" / f"trial{trial.number:03d}" / "seed0"
    on_slurm.run("scontrol", "requeue", job)
    on_slurm.wait_for(lambda: "stopped at round 2" in (run / "fit.log").read_text(), "the run to stop after round 2")
    released = threading.Event()

    def release():  # the other runs pass their hold at once from now on
        while not released.wait(0.05):
            ready.unlink(missing_ok=True)

    remover = threading.Thread(target=release, daemon=True)
    remover.start()
    try:
        on_slurm.start_now(job)
        # the jobs' state alone was seen COMPLETED while a worker still ran its last trial (CI, 2026-11-29): wait for
        # the study too
        on_slurm.wait_for(lambda: all(on_slurm.job(j)["JobState"] == "COMPLETED" for j in workers()) and not any(
            t.state == optuna.trial.TrialState.RUNNING for t in _trials(url)), "both worker jobs to complete", 300)
    finally:
        released.set()
        remover.join()
    assert on_slurm.job(job)["Restarts"] == "1"
    states = optuna.trial.TrialState
    after = _trials(url)
    assert sorted(t.number for t in after) == [0, 1, 2, 3] and {t.state for t in after} <= {states.COMPLETE,
                                                                                            states.PRUNED}
    assert sorted(p.name for p in (out / "fedavg").iterdir()) == ["trial000", "trial001", "trial002", "trial003"]
    for t in after:  # each trial run once: its rounds recorded once each, a finished one all of them
        rounds = _rows(out / "fedavg" / f"trial{t.number:03d}" / "seed0")
        assert rounds == list(range(1, len(rounds) + 1)) and (t.state == states.PRUNED or len(rounds) == ROUNDS)
    log = (run / "fit.log").read_text()
    assert "stopped at round 2 by SIGTERM" in log and "resumed from round 2" in log
    resumer = next(t for t in after if t.number == trial.number).user_attrs[tune_study.WORKER]
    assert resumer["pid"] != worker["pid"]  # the requeued job's new process, or the other worker
    assert "budget spent" in (out / "tune.md").read_text()
