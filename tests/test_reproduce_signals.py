"""``fedlight reproduce`` records what its runs did whichever signal arrives when (issue 68, item 6): an attempt
SIGKILLed while its lockstep group trains (the group stops after its round in progress, nobody records it), then a
SIGTERM to the resuming attempt before it starts a run, or after its runs ended."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedlight.config.cli import main
from fedlight.lab.tables import jobs, runner, table_report
from fedlight.run.directory import LOCK_NAME

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("fedavg", "fedprox")


@pytest.fixture
def killed(tmp_path, monkeypatch):
    """``reproduce --lockstep column`` SIGKILLed while its group is in round 3: the group, left without its parent,
    stops after that round (its checkpoint written); the runs' job.json still say running, with the dead pid."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    Path("t.yaml").write_text(yaml.safe_dump({
        "title": "Two rows", "base": "recipes/quickstart.yaml", "metric": "final_test_acc",
        "rows": {"fedavg": {"algorithm": {"class_path": "fedlight.algorithms.FedAvg"}},
                 "fedprox": {"algorithm": {"class_path": "fedlight.algorithms.FedProx", "init_args": {"mu": 0.01}}}},
        "columns": {"synthetic": {}}}, sort_keys=False))
    argv = ["t.yaml", "--shrink", "rounds=4,test_subset=128,loop.local_steps=2", "--out", "out", "--lockstep",
            "column"]
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FEDLIGHT_FAULT": "train@3:pause",
           "FEDLIGHT_FAULT_READY": str(ready)}
    proc = subprocess.Popen([sys.executable, "-m", "fedlight.config.cli", "reproduce", *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    runs = [tmp_path / "out" / r / "synthetic" / "seed0" for r in RUNS]
    while any((r / LOCK_NAME).exists() for r in runs):  # the orphaned group finishes its round and leaves
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for r in runs:
        assert jobs.read(r)["state"] == "running" and jobs.read(r)["pid"] == proc.pid
        assert jobs.rounds_done(r) == 3
    return argv, runs


def _sigterm(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # handled at once, by the handler the command runs under
    raise AssertionError("not stopped")


def test_a_sigterm_before_the_resuming_attempt_starts_its_runs(killed, capsys, monkeypatch):
    argv, runs = killed
    monkeypatch.setattr(runner, "launch", _sigterm)
    capsys.readouterr()
    assert main(["reproduce", *argv]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedlight reproduce: stopped by SIGTERM before it started a run; its runs: 2 stopped after a "
                   f"finished round (fedavg/synthetic seed0 at round 3, fedprox/synthetic seed0 at round 3), 0 "
                   f"finished, 0 not started; to continue, run the same command again: fedlight reproduce "
                   f"{' '.join(argv)}"], err
    for r in runs:
        job = jobs.read(r)
        assert job["state"] == "stopped", job
        assert job["note"].startswith("3 rounds done; its launcher (process "), job


def test_a_sigterm_after_the_runs_ended(killed, capsys, monkeypatch):
    argv, runs = killed
    capsys.readouterr()
    assert main(["reproduce", *argv]) == 0  # the runs resume and finish
    said = capsys.readouterr().out
    assert "2 runs in 1 processes, the runs that share a stacked chunk in lockstep groups (--lockstep column)" in said
    assert all(jobs.read(r)["state"] == "done" for r in runs)
    monkeypatch.setattr(table_report, "write_table", _sigterm)
    capsys.readouterr()
    assert main(["reproduce", *argv]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fedlight reproduce: stopped by SIGTERM after its runs ended; its runs: 0 stopped "
                              "after a finished round, 2 finished, 0 not started"), err
    assert json.loads((runs[0] / "summary.json").read_text())["rounds_completed"] == 4
