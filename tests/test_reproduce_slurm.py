"""``fedlight reproduce --launcher slurm`` through submitit (its local executor: real submitit, jobs as local
processes), ``--status``, ``--per-gpu`` packing and the Slurm resources."""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_reproduce import _processes_naming, write_spec

from fedlight.config.cli import main
from fedlight.errors import ConfigError
from fedlight.lab.tables import jobs, runner
from fedlight.lab.tables import spec as table_spec

submitit = pytest.importorskip("submitit")
SHRINK = ["--shrink", "rounds=4,subset=512,test_subset=128,loop.local_steps=2"]


def _wait(condition, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _table(out):
    """The table's values, timings left out."""
    return {(r["cell"], r["metric"]): r["values"] for r in csv.DictReader((out / "table.csv").open())
            if r["metric"] != "seconds_per_round"}


def test_a_preempted_slurm_job_is_requeued_and_its_table_equals_an_uninterrupted_run(tmp_path, monkeypatch,
                                                                                      capsys):
    """Two cells packed into one job (``--per-gpu 2``); the job is signalled as Slurm does before preemption or
    the time limit (SIGUSR2, submitit's handler); its runs stop after round 2 with their checkpoints, submitit
    requeues the job and the runs resume: the table equals one from runs that were never stopped."""
    spec = write_spec(tmp_path / "quick.yaml")
    with monkeypatch.context() as here:  # the uninterrupted runs: in this process, to save interpreter starts
        here.setattr(runner.Children, "call", lambda self, cmd, stdout, stderr, env: main(cmd[3:]))
        assert main(["reproduce", str(spec), *SHRINK, "--out", str(tmp_path / "ref")]) == 0
    out = tmp_path / "out"
    args = [str(spec), *SHRINK, "--out", str(out), "--launcher", "slurm", "--cluster", "local"]
    monkeypatch.setenv("FEDLIGHT_FAULT", "train@2:pause")  # each run waits in round 2 for the signal
    assert main(["reproduce", *args, "--per-gpu", "2"]) == 0
    assert "submitted 2 runs in 1 jobs" in capsys.readouterr().out
    runs = [out / cell / "synthetic" / "seed0" for cell in ("fedavg", "fedprox")]
    _wait(lambda: all(jobs.rounds_done(r) >= 1 and jobs.read(r).get("state") == "running" for r in runs),
          "both runs to finish round 1")
    assert main(["reproduce", *args, "--status"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2 runs: 2 running"
    pid = jobs.read(runs[0])["pid"]
    assert pid == jobs.read(runs[1])["pid"] != os.getpid()  # one job process holds both runs
    os.kill(pid, signal.SIGUSR2)
    _wait(lambda: all((r / "summary.json").is_file() for r in runs), "the requeued job to finish")
    for r in runs:
        assert "stopped at round 2 by SIGUSR1; continue with --resume auto" in (r / "fit.log").read_text()
        assert "resumed from round 2" in (r / "fit.log").read_text()
        assert [json.loads(x)["round"] for x in (r / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    _wait(lambda: all(jobs.read(r).get("state") == "done" for r in runs), "job.json to say done")
    assert main(["reproduce", *args, "--status"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2 runs: 2 done"
    assert main(["reproduce", *args, "--table-only"]) == 0
    assert _table(out) == _table(tmp_path / "ref")


def test_sigusr1_to_a_job_process_stops_its_runs_records_them_and_the_same_command_resumes(tmp_path, monkeypatch,
                                                                                          capsys):
    """SIGUSR1 (or Ctrl-C) sent to a submitit job process itself, not through Slurm's end-of-job signal: the job
    passes it on to its runs, each stops after its round with its checkpoint, job.json and ``--status`` say
    "stopped" (not "running"), no `fedlight fit` outlives the job, and the same command resumes them."""
    spec = write_spec(tmp_path / "quick.yaml")
    out = tmp_path / "out"
    args = [str(spec), *SHRINK, "--out", str(out), "--launcher", "slurm", "--cluster", "local", "--per-gpu", "2"]
    monkeypatch.setenv("FEDLIGHT_FAULT", "train@2:pause")
    assert main(["reproduce", *args]) == 0
    runs = [out / cell / "synthetic" / "seed0" for cell in ("fedavg", "fedprox")]
    _wait(lambda: all(jobs.rounds_done(r) >= 1 and jobs.read(r).get("state") == "running" for r in runs),
          "both runs to finish round 1")
    os.kill(jobs.read(runs[0])["pid"], signal.SIGUSR1)
    _wait(lambda: all(jobs.read(r).get("state") == "stopped" for r in runs), "job.json to say stopped")
    _wait(lambda: not _processes_naming(str(out / "fedavg")) and not _processes_naming(str(out / "fedprox")),
          "no fit process left")
    for r in runs:
        assert "stopped at round 2 by SIGUSR1" in (r / "fit.log").read_text()
        assert jobs.rounds_done(r) == 2
    assert main(["reproduce", *args, "--status"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2 runs: 2 stopped"
    monkeypatch.delenv("FEDLIGHT_FAULT")
    assert main(["reproduce", *args, "--wait"]) == 0
    for r in runs:
        assert "resumed from round 2" in (r / "fit.log").read_text() and (r / "summary.json").is_file()


def test_a_running_record_whose_launcher_died_reads_as_stopped(tmp_path, capsys):
    """A launcher killed outright (SIGKILL: nothing can record it) leaves job.json "running"; ``--status`` sees
    that no process of that id lives on this host and says "stopped", naming the process."""
    spec = write_spec(tmp_path / "quick.yaml")
    s = table_spec.load_spec(spec)
    run = runner.plan(s, table_spec.cells(s)[:1], [0], tmp_path / "o", None)[0]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    jobs.mark(run.path, state="running", pid=dead.pid, host=jobs.host())
    st, detail = jobs.state(run)
    assert st == "stopped" and f"process {dead.pid}" in detail and "the same command resumes it" in detail
    jobs.mark(run.path, pid=os.getpid())
    assert jobs.state(run)[0] == "running"
    jobs.mark(run.path, pid=dead.pid, host="another-host")  # another machine's process cannot be seen: trusted
    assert jobs.state(run)[0] == "running"


def test_status_names_each_state_and_the_last_log_line_of_a_failure(tmp_path, capsys):
    spec = write_spec(tmp_path / "quick.yaml", mu=0.1)
    s = table_spec.load_spec(spec)
    s["rows"]["scaffold"] = {"algorithm": {"class_path": "fedlight.algorithms.SCAFFOLD"}}
    spec.write_text(json.dumps(s))
    out = tmp_path / "o"
    runs = {r.cell.row: r for r in runner.plan(s, table_spec.cells(s), [0], out, None)}
    jobs.mark(runs["fedavg"].path, state="pending", job="4242_0")
    jobs.mark(runs["fedprox"].path, state="failed", rc=2)
    (runs["fedprox"].path / "fit.log").write_text("fedlight: run directory x\nfedlight fit: error: `loop.lr` ...\n")
    assert main(["reproduce", str(spec), "--out", str(out), "--status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["fedavg/synthetic", "seed0", "pending"] and "job 4242_0" in lines[0]
    assert lines[1].split()[:3] == ["fedprox/synthetic", "seed0", "failed"]
    assert lines[1].endswith("exit status 2: fedlight fit: error: `loop.lr` ...")
    assert lines[2].split()[:4] == ["scaffold/synthetic", "seed0", "not", "started"]
    assert lines[3] == "3 runs: 1 failed, 1 not started, 1 pending"
    gone = lambda job_id: "NODE_FAIL"  # noqa: E731 - the scheduler forgot a job that job.json calls pending
    assert "the scheduler reports NODE_FAIL" in jobs.state(runs["fedavg"], gone)[1]


def test_slurm_resources_come_from_the_spec_and_the_flags(tmp_path):
    from fedlight.lab.tables import slurm

    res = slurm.resources({"slurm": {"partition": "gpu", "time": "1-02:30:00", "gpus": 2, "sbatch": {"qos": "hi"}}},
                          {"time": None, "mem": 64, "per_gpu": 4, "account": "fl"})
    assert (res.partition, res.minutes(), res.gpus, res.mem, res.account, res.per_job()) == \
        ("gpu", 26 * 60 + 30, 2, 64, "fl", 8)
    params = slurm.executor_parameters(res)
    assert params["slurm_additional_parameters"] == {"qos": "hi"} and params["gpus_per_node"] == 2
    assert params["timeout_min"] == 1590 and params["slurm_partition"] == "gpu" and params["slurm_mem"] == "64G"
    assert params["slurm_signal_delay_s"] == 120
    generic, own = submitit.AutoExecutor._valid_parameters(), submitit.SlurmExecutor._valid_parameters()
    assert all(k in generic or (k.startswith("slurm_") and k[6:] in own) for k in params)  # names submitit knows
    assert [slurm.Resources(time=t).minutes() for t in (90, "45", "1:30", "2:00:00", "1-2", "1-0:30", "1-0:30:15")] \
        == [90, 45, 2, 120, 26 * 60, 24 * 60 + 30, 24 * 60 + 31]  # sbatch's forms (seconds rounded up to a minute)
    assert [slurm.Resources(mem=m).mem_text() for m in (4, "4", "4G", "4000M", "1T", "512k")] == \
        ["4G", "4G", "4G", "4000M", "1T", "512k"]  # a plain number is GB, as before; sbatch's units pass unchanged
    for bad in ("4GB", "4.5G", "-4", "04G", ""):
        with pytest.raises(ConfigError, match="`--mem`"):
            slurm.resources({}, {"mem": bad})
    with pytest.raises(ConfigError, match="no room for the end-of-job signal 120 s"):
        slurm.resources({}, {"time": "2"})
    assert slurm.resources({"slurm": {"signal_s": 50}}, {"time": "2"}).signal_s == 50
    given = argparse.Namespace(**{k: None for k in runner.CLUSTER_FLAGS})
    given.mem, given.sbatch = "4000M", ["qos=high", "exclusive", "--begin=now+1hour", "comment=a=b"]
    passed = slurm.executor_parameters(slurm.resources({}, runner.slurm_flags(given)))
    assert passed["slurm_additional_parameters"] == \
        {"qos": "high", "exclusive": True, "begin": "now+1hour", "comment": "a=b"}  # bare: an option without value
    assert passed["slurm_mem"] == "4000M"
    with pytest.raises(ConfigError, match="unknown keys.*'partitoin'"):
        slurm.resources({"slurm": {"partitoin": "gpu"}}, {})
    with pytest.raises(ConfigError, match="--time"):
        slurm.resources({}, {"time": "soon"})
    # --per-gpu 4 on 2 GPUs: eight runs per job, slots 0-3 on the job's first GPU, 4-7 on its second
    env = {"CUDA_VISIBLE_DEVICES": "3,5"}
    assert [slurm.slot_env(env, k, res, 8)["CUDA_VISIBLE_DEVICES"] for k in range(8)] == ["3"] * 4 + ["5"] * 4
    assert [len(g) for g in slurm.groups(list(range(19)), res.per_job())] == [8, 8, 3]


def test_local_per_gpu_gives_each_process_its_gpu(tmp_path, monkeypatch, capsys):
    import threading

    import torch

    spec = write_spec(tmp_path / "quick.yaml")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    seen, lock = [], threading.Lock()

    def fake_fit(children, cmd, stdout, stderr, env):
        with lock:
            seen.append(env["CUDA_VISIBLE_DEVICES"])
        return 0

    monkeypatch.setattr(runner.Children, "call", fake_fit)
    plain = ["--seeds", "3", "--per-gpu", "3", "--lockstep", "off", "--out", str(tmp_path / "o")]  # runs, not groups
    main(["reproduce", str(spec), *plain, "--table-only"])
    main(["reproduce", str(spec), *plain])
    assert len(seen) == 6 and set(seen) <= {"0", "1"}
    assert runner.gpu_slots(2, 2) == ["0", "0", "1", "1"] and runner.gpu_slots(None, 0) is None
    with pytest.raises(ConfigError, match="--per-gpu.*shows none"):
        runner.gpu_slots(2, 0)
    assert main(["reproduce", str(spec), "--partition", "gpu", "--out", str(tmp_path / "o")]) == 2
    assert "need `--launcher slurm`" in capsys.readouterr().err


def test_the_slurm_launcher_and_the_runner_import_no_circle():
    """the runner imports slurm (for ``--launcher slurm``); slurm imports nothing of reproduce, not even inside a
    function: a job gets the functions that run a run from the launcher, pickled with it."""
    import ast
    import inspect

    from fedlight.lab.tables import slurm

    def imported(module) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names |= {f"{node.module}.{a.name}" for a in node.names} | {node.module or ""}
        return names

    assert "fedlight.lab.tables.slurm" in imported(runner)
    assert not {n for n in imported(slurm) | imported(jobs)
                if n.startswith(("fedlight.lab.tables.reproduce", "fedlight.lab.tables.runner"))}
