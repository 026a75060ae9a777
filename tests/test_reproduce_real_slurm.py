"""``fedlight reproduce --launcher slurm`` on a real single-node Slurm (the ``slurm_cluster`` fixture:
tools/slurm_single_node.sh): sbatch, the scheduler's states, a requeue, a time limit, scancel, and sbatch's own
spellings of the resources. Skipped, with the reason, where no Slurm can be started (not root, no apt-get)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import pytest
import torch
from test_reproduce import write_spec
from test_reproduce_slurm import _table

from fedlight.config.cli import main
from fedlight.lab.tables import jobs, runner
from fedlight.lab.tables import spec as table_spec

pytest.importorskip("submitit")
SHRINK = ["--shrink", "rounds=4,subset=512,test_subset=128,loop.local_steps=2"]
RUN = Path("fedavg", "synthetic", "seed0")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The table's four runs with the local launcher (in this process: no interpreter starts), never stopped."""
    root = tmp_path_factory.mktemp("reference")
    spec = write_spec(root / "quick.yaml")
    with pytest.MonkeyPatch.context() as here:
        here.setattr(runner.subprocess, "call", lambda cmd, stdout, stderr, env: main(cmd[3:]))
        assert main(["reproduce", str(spec), *SHRINK, "--seeds", "2", "--out", str(root / "out")]) == 0
    return root / "out"


@pytest.fixture
def on_slurm(slurm_cluster, monkeypatch):
    """This test's commands (and the jobs, which get its environment) talk to the single-node Slurm."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the reference runs in this process
    return slurm_cluster


def _args(spec, out, *extra, mem="1G"):
    return ["reproduce", str(spec), *SHRINK, "--out", str(out), "--launcher", "slurm", "--partition", "debug",
            "--cpus", "1", "--mem", mem, *extra]


def _cli(args, cluster, capsys, timeout=240) -> tuple[int, str]:
    """``fedlight`` in this process (no interpreter starts), time-bounded: past ``timeout`` every job of the cluster
    is cancelled, so ``--wait`` returns (and the test fails, saying so); its exit status and what it printed."""
    fired = []

    def cancel_all():
        fired.append(True)
        cluster.run("scancel", "--user", "root")

    capsys.readouterr()
    watchdog = threading.Timer(timeout, cancel_all)
    watchdog.start()
    try:
        rc = main(args)
    finally:
        watchdog.cancel()
    out, err = capsys.readouterr()
    assert not fired, f"`fedlight {' '.join(args[:2])}` took over {timeout} s: its jobs were cancelled\n{err[-2000:]}"
    return rc, out + err[-2000:]


def _ended(cluster, job: str) -> None:
    """``--wait`` has returned only once Slurm shows the job in a final state (a job's result file is written just
    before its process exits, so waiting for the file alone left ``--status`` showing RUNNING or COMPLETING)."""
    state = cluster.job(job)["JobState"]
    assert state not in jobs.LIVE, f"--wait returned while Slurm shows job {job} {state}"


def _status(spec, out, capsys) -> list[str]:
    capsys.readouterr()
    assert main(["reproduce", str(spec), *SHRINK, "--out", str(out), "--status"]) == 0
    return capsys.readouterr().out.splitlines()


def _same_model(run, reference):
    final, ref = (torch.load(p / "final_model.pt", weights_only=True) for p in (run, reference / RUN))
    assert final.keys() == ref.keys() and all(torch.equal(final[k], ref[k]) for k in ref)
    assert [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_job_at_its_time_limit_is_requeued_by_the_launcher_and_finishes(on_slurm, tmp_path, monkeypatch, request):
    """``--time 2`` with the end-of-job signal 50 s before it (``slurm.signal_s``; Slurm sends it up to its 30 s
    check period earlier: 40 to 70 s into the job): the signal finds the run waiting in round 2; the launcher stops
    the run (SIGUSR1) and requeues the job, which resumes the run. (The first test of the module: the uninterrupted
    reference runs, in this process, are made while the job waits for its signal.)"""
    spec, out = write_spec(tmp_path / "quick.yaml"), tmp_path / "out"
    s = table_spec.load_spec(spec)
    spec.write_text(json.dumps({**s, "slurm": {"signal_s": 50}}))
    with monkeypatch.context() as paused:  # the job's environment only: the reference runs below must not pause
        paused.setenv("FEDLIGHT_FAULT", "train@2:pause")  # waits (up to 300 s) there for a signal
        assert main([*_args(spec, out, "--cells", "fedavg/*", "--time", "2")]) == 0
    reference = request.getfixturevalue("reference")  # some 30 s of the 40 to 70 the job waits for its signal
    on_slurm.wait_for(lambda: jobs.read(out / RUN).get("job"), "the job to start")
    job = str(jobs.read(out / RUN)["job"])
    assert on_slurm.job(job)["TimeLimit"] == "00:02:00"
    on_slurm.wait_for(lambda: on_slurm.job(job).get("Reason") == "BeginTime", "the launcher to requeue the job")
    # the resumed attempt gets room (a loaded machine must not meet a second end-of-job signal: that is not what
    # this test checks), and starts now, not after Slurm's two-minute requeue delay
    on_slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")
    on_slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    on_slurm.wait_for(lambda: jobs.read(out / RUN).get("state") == "done", "the requeued job to finish the run", 300)
    log = (out / RUN / "fit.log").read_text()
    assert "stopped at round 2 by SIGUSR1" in log and "resumed from round 2" in log  # the launcher's stop, in time
    _same_model(out / RUN, reference)
    assert on_slurm.job(job)["Restarts"] == "1"


def test_a_table_on_slurm_equals_the_local_launchers(on_slurm, reference, tmp_path, capsys):
    spec, out = write_spec(tmp_path / "quick.yaml"), tmp_path / "out"
    rc, said = _cli([*_args(spec, out, "--seeds", "2", "--per-gpu", "2", "--wait")], on_slurm, capsys)
    assert rc == 0, said  # a cell's two seeds per job
    assert "submitted 4 runs in 2 jobs" in said
    assert _table(out) == _table(reference)
    for run in (out / c / "synthetic" / f"seed{k}" for c in ("fedavg", "fedprox") for k in (0, 1)):
        job = jobs.read(run)
        assert (job["state"], job["launcher"]) == ("done", "slurm")
        _ended(on_slurm, str(job["job"]))
        info = on_slurm.job(str(job["job"]))  # Slurm's own record of the job that ran it
        assert (info["JobState"], info["MinMemoryNode"], info["NumCPUs"]) == ("COMPLETED", "1G", "1")


def test_a_requeued_slurm_job_resumes_and_ends_bitwise_equal(on_slurm, reference, tmp_path, monkeypatch, capsys):
    """``scontrol requeue`` of a running job: the run stops after its round (Slurm's SIGTERM), ``--status`` shows
    Slurm's states as they go (running, pending after the requeue, completed), and the job runs again and resumes
    the run, which ends bitwise where the uninterrupted one did."""
    spec, out, ready = write_spec(tmp_path / "quick.yaml"), tmp_path / "out", tmp_path / "ready"
    monkeypatch.setenv("FEDLIGHT_FAULT", "train@2:pause")  # the run waits in round 2 (up to 300 s) for a signal
    monkeypatch.setenv("FEDLIGHT_FAULT_READY", str(ready))
    assert main([*_args(spec, out, "--cells", "fedavg/*")]) == 0
    on_slurm.wait_for(ready.exists, "the run to reach round 2")
    job = str(jobs.read(out / RUN)["job"])
    line = _status(spec, out, capsys)[0]
    assert line.split()[2] == "running" and line.endswith("Slurm: RUNNING"), line
    on_slurm.run("scontrol", "requeue", job)
    on_slurm.wait_for(lambda: on_slurm.job(job).get("Reason") == "BeginTime", "Slurm to requeue the job")
    on_slurm.wait_for(lambda: jobs.read(out / RUN).get("state") == "stopped", "job.json to say stopped")
    line = _status(spec, out, capsys)[0]
    assert line.split()[2] == "stopped" and line.endswith("Slurm: PENDING (BeginTime), requeued 1×"), line
    # the resumed attempt gets room (a loaded machine must not meet a second end-of-job signal: that is not what
    # this test checks), and starts now, not after Slurm's two-minute requeue delay
    on_slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")
    on_slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    on_slurm.wait_for(lambda: jobs.read(out / RUN).get("state") == "done", "the requeued job to finish the run", 300)
    log = (out / RUN / "fit.log").read_text()
    assert "stopped at round 2 by SIGTERM" in log and "resumed from round 2" in log
    _same_model(out / RUN, reference)
    on_slurm.wait_for(lambda: on_slurm.job(job)["JobState"] == "COMPLETED", "the job to complete")
    assert _status(spec, out, capsys)[0].split()[2:] == ["done", "Slurm:", "COMPLETED,", "requeued", "1×"]


def test_scancel_leaves_the_run_stopped_and_the_same_command_resumes_it(on_slurm, reference, tmp_path, monkeypatch,
                                                                        capsys):
    """``scancel`` of the job of a ``--wait`` command: the command returns (it fails: the run is not finished), the
    run is "stopped" next to Slurm's CANCELLED, and the same command resubmits the run, which resumes."""
    spec, out, ready = write_spec(tmp_path / "quick.yaml"), tmp_path / "out", tmp_path / "ready"
    command = [sys.executable, "-m", "fedlight.config.cli", *_args(spec, out, "--cells", "fedavg/*", "--wait")]
    with monkeypatch.context() as paused:
        paused.setenv("FEDLIGHT_FAULT", "train@2:pause")
        paused.setenv("FEDLIGHT_FAULT_READY", str(ready))
        waiting = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        on_slurm.wait_for(ready.exists, "the run to reach round 2")
        job = str(jobs.read(out / RUN)["job"])
        on_slurm.run("scancel", job)
        _, err = waiting.communicate(timeout=120)  # without accounting, submitit alone would wait for ever
        assert waiting.returncode == 1, err[-2000:]
    finally:
        waiting.kill()
    assert jobs.read(out / RUN)["state"] == "stopped" and on_slurm.job(job)["JobState"] == "CANCELLED"
    line = _status(spec, out, capsys)[0]
    assert line.split()[2:6] == ["stopped", "2", "rounds", "done,"] and line.endswith("Slurm: CANCELLED"), line
    rc, said = _cli([*_args(spec, out, "--cells", "fedavg/*", "--wait")], on_slurm, capsys)
    assert rc == 0, said
    assert "resumed from round 2" in (out / RUN / "fit.log").read_text()
    _same_model(out / RUN, reference)


def test_status_reads_a_failed_job_from_slurm(on_slurm, tmp_path, monkeypatch, capsys):
    """A run killed in round 1: the job fails; ``--wait`` returns (and the command fails) and ``--status`` shows
    the run failed with Slurm's FAILED."""
    spec, out = write_spec(tmp_path / "quick.yaml"), tmp_path / "out"
    monkeypatch.setenv("FEDLIGHT_FAULT", "train@1:kill")
    rc, said = _cli([*_args(spec, out, "--cells", "fedavg/*", "--wait")], on_slurm, capsys)
    assert rc == 1, said
    _ended(on_slurm, str(jobs.read(out / RUN)["job"]))
    line = _status(spec, out, capsys)[0]
    assert line.split()[2:5] == ["failed", "exit", "status"] and line.endswith("; Slurm: FAILED (NonZeroExitCode)")


def test_sbatch_takes_the_resources_as_slurm_spells_them(on_slurm, tmp_path, capsys):
    """Every ``--time`` form and ``--mem`` unit gives the job sbatch itself gives for the same text; ``--sbatch``
    options (with and without a value) reach sbatch unchanged. The jobs are held, so nothing runs."""
    spec = write_spec(tmp_path / "quick.yaml")
    s = table_spec.load_spec(spec)
    spec.write_text(json.dumps({**s, "slurm": {"signal_s": 30}}))
    spellings = [("90", "4G"), ("1:30", "4000M"), ("2:00:00", "2"), ("1-2", "1500M"), ("1-0:30", "1G"),
                 ("1-00:30:15", "2G")]
    held = []
    for k, (time, mem) in enumerate(spellings):
        out = tmp_path / f"out{k}"
        assert main(_args(spec, out, "--cells", "fedavg/*", "--time", time, "--sbatch", "hold", "--sbatch",
                          f"comment=spelling-{k}", "--sbatch", "begin=now+1hour", mem=mem)) == 0
        ours = on_slurm.job(str(jobs.read(out / RUN)["job"]))
        sbatch_mem = mem + "G" if mem.isdigit() else mem  # fedlight's plain number is GB (sbatch's is MB)
        theirs = on_slurm.job(on_slurm.run("sbatch", "--parsable", "--hold", f"--time={time}", f"--mem={sbatch_mem}",
                                           "--wrap", "true").strip())
        held += [ours["JobId"], theirs["JobId"]]
        assert (ours["TimeLimit"], ours["MinMemoryNode"]) == (theirs["TimeLimit"], theirs["MinMemoryNode"]), (time, mem)
        assert (ours["Comment"], ours["Reason"], ours["JobState"]) == (f"spelling-{k}", "JobHeldUser", "PENDING")
        eligible, submitted = (datetime.fromisoformat(ours[k]) for k in ("EligibleTime", "SubmitTime"))
        assert 3590 <= (eligible - submitted).total_seconds() <= 3610  # begin=now+1hour
        line = _status(spec, out, capsys)[0]
        assert line.split()[2] == "pending" and line.endswith("Slurm: PENDING (JobHeldUser)"), line
    on_slurm.run("scancel", *held)
    assert main(_args(spec, tmp_path / "bad", mem="4GB")) == 2
    assert "`--mem` (or the spec's `slurm.mem`) '4GB'" in capsys.readouterr().err


def test_the_docs_single_node_section_runs_as_written(slurm_cluster, tmp_path):
    """docs/clusters.md "Try it on one machine": its block, as written, in a folder with the doc's toy table (and
    the checkout's tools/), on a Slurm of its own (the script's default folder; a free port)."""
    from slurm_cluster import SCRIPT, free_port_pair
    from test_docs import DOCS, blocks

    doc = blocks(DOCS / "clusters.md")
    block = next(b for b in doc if b.lang == "bash" and "slurm_single_node.sh start" in b.code)
    for b in doc:
        if b.file:
            (tmp_path / b.file).write_text(b.code)
    (tmp_path / "tools").symlink_to(SCRIPT.parent)
    env = {**os.environ, "FEDLIGHT_SLURM_PORT": str(free_port_pair()),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    env.pop("SLURM_CONF", None)
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.splitlines()[-2].split()[2:] == ["done", "Slurm:", "COMPLETED"]
    assert jobs.read(tmp_path / "runs" / "toy_single_node" / "fedavg" / "result" / "seed0")["launcher"] == "slurm"
