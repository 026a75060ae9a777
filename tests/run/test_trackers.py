"""Trackers (issue 43) against the real tools: MLflow on a SQLite store, W&B offline run files, Lightning's CSVLogger.

MLflow's import costs seconds, so its assertions are grouped in two tests; runs are tests/configs/tiny.yaml.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from fedlight.config.cli import main
from fedlight.lab.tables import runner
from fedlight.run.directory import flatten
from fedlight.run.trackers import metrics_of

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
ROOT = Path(__file__).resolve().parents[2]


def _cli(out, *extra, env=None, cwd=None):
    cmd = [sys.executable, "-m", "fedlight.config.cli", "fit", "--config", TINY, "--out_dir", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def _rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _assert_history(client, run_id, rows):
    """Every number of every metrics.jsonl row is in the tracker once, at its round."""
    for key in set().union(*(metrics_of(r) for r in rows)):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        want = [(r["round"], float(r[key])) for r in rows if key in metrics_of(r)]
        assert history == want, key


def test_unknown_logger_is_one_line_before_anything(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["fit", "--config", TINY, "--out_dir", str(out), "--loggers", "[tensorboard, mlfow]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedlight fit: error: `loggers`: unknown logger 'mlfow'; did you mean 'mlflow'? (give "
                   "tensorboard, mlflow, wandb, csv or a class path such as lightning.pytorch.loggers.X)"], err
    assert not out.exists()


@pytest.fixture()
def mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    store = tmp_path / "store"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    return uri


def test_mlflow_one_run_per_fit_kept_through_sigkill_and_resume(mlflow_store, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    out.mkdir()  # as `fedlight reproduce` leaves it: the cell's tags
    (out / "reproduce.json").write_text(json.dumps({"cell": {"table": "t1", "row": "fedavg", "column": "dir0.1",
                                                             "seed": 0}}))
    args = ["--loop.rounds", "5", "--loop.save_every", "2", "--loggers", "[tensorboard, mlflow]", "--resume", "auto"]
    killed = _cli(out, *args, env={"FEDLIGHT_FAULT": "train@4"}, cwd=tmp_path)  # in round 4; checkpoint at 2
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    first = json.loads((out / "trackers.json").read_text())["mlflow"]
    assert first["logged"] == 2  # round 3 waits for its checkpoint: recomputed after the kill, it is logged once
    assert main(["fit", "--config", TINY, "--out_dir", str(out), *args]) == 0  # --resume auto

    runs = mlflow.search_runs(experiment_names=["fedlight"], output_format="list")
    assert len(runs) == 1  # the resumed fit continued the same MLflow run
    run = runs[0]
    summary = json.loads((out / "summary.json").read_text())
    assert run.info.run_id == first["id"] == summary["trackers"]["mlflow"]["id"]
    assert summary["trackers"]["mlflow"]["missed_rounds"] is None
    assert run.info.status == "FINISHED"
    rows = _rows(out)
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5]
    client = MlflowClient(mlflow_store)
    _assert_history(client, run.info.run_id, rows)  # round 3 (logged, then recomputed after the kill) once
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert run.data.params == {k: str(v) for k, v in flatten(config).items()}
    tags = run.data.tags
    assert {k: tags[k] for k in ("algorithm", "model", "data", "seed", "table", "row", "column")} == {
        "algorithm": "scaffold", "model": "MLP", "data": "Synthetic", "seed": "0", "table": "t1", "row": "fedavg",
        "column": "dir0.1"}
    assert tags["run_dir"] == str(out.resolve()) and tags["fedlight_version"] and "git_revision" in tags
    assert run.data.metrics["summary/final_test_acc"] == summary["final_test_acc"]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "summary.json",
                                                                         "final_model.pt"}
    assert (out / "tb").is_dir()  # TensorBoard beside it
    assert not (tmp_path / "mlruns").exists() and (tmp_path / "store" / "mlruns").is_dir()  # beside mlflow.db


def test_mlflow_without_a_tracking_uri_logs_to_mlflows_default_sqlite_store(tmp_path, monkeypatch, capsys):
    """No MLFLOW_* variable and no tracking_uri: Lightning's MLFlowLogger would use a ./mlruns file store, which
    MLflow 3 refuses (exit 2). fedlight takes MLflow's own default, ./mlflow.db (what `mlflow ui` opens), says so in
    one line, and a resume started in another folder continues the same MLflow run in that store."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    cmd = [sys.executable, "-m", "fedlight.config.cli", "fit", "--config", TINY, "--out_dir", str(out), "--loggers",
           "[tensorboard, mlflow]"]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    said = [line for line in res.stderr.splitlines() if "mlflow" in line.lower() and "run directory" not in line]
    assert said == [f"fedlight: note: mlflow: logging to {uri}, MLflow's default store (MLFLOW_TRACKING_URI or the "
                    f"logger's tracking_uri chooses another; `mlflow ui --backend-store-uri {uri}` shows it)"], said
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedlight").experiment_id])
    _assert_history(client, run.info.run_id, _rows(out))
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "summary.json",
                                                                         "final_model.pt"}
    assert (tmp_path / "mlruns").is_dir()  # the artifacts beside mlflow.db

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for k in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(k)
    monkeypatch.chdir(elsewhere)
    assert main(["fit", "--config", TINY, "--out_dir", str(out), "--loop.rounds", "3", "--resume", "auto",
                 "--loggers", "[tensorboard, mlflow]"]) == 0
    assert f"logging to {uri}" in capsys.readouterr().err and not (elsewhere / "mlflow.db").exists()
    (again,) = client.search_runs([run.info.experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    _assert_history(client, run.info.run_id, _rows(out))  # rounds 1-3, once each


def _freeze(folder: Path, on: bool) -> None:
    """Make ``folder`` and its files read-only, for root too (the immutable flag), or writable again."""
    paths = [folder, *folder.iterdir()]
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i" if on else "-i", *map(str, paths)], check=True)
    else:
        for p in paths:
            p.chmod((0o555 if p.is_dir() else 0o444) if on else 0o755)


def test_mlflow_unreachable_refused_and_store_lost_mid_run_recorded(mlflow_store, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    # unreachable at start: one line, exit 2, no round
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    out = tmp_path / "refused"
    assert main(["fit", "--config", TINY, "--out_dir", str(out), "--loggers", "mlflow"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "`loggers`: cannot start mlflow at http://127.0.0.1:9" in err[0], err
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()

    # the store turns read-only during round 3: the run finishes, every round in metrics.jsonl, the gap recorded
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    store, ready, out = tmp_path / "store", tmp_path / "ready", tmp_path / "run"
    monkeypatch.setenv("FEDLIGHT_FAULT", "train@3:hold")
    monkeypatch.setenv("FEDLIGHT_FAULT_READY", str(ready))

    def freeze_when_held():
        while not ready.exists():
            time.sleep(0.02)
        _freeze(store, True)
        ready.unlink()

    helper = threading.Thread(target=freeze_when_held, daemon=True)
    helper.start()
    try:
        assert main(["fit", "--config", TINY, "--out_dir", str(out), "--loop.rounds", "4", "--loggers", "mlflow"]) == 0
    finally:
        helper.join(5)
        _freeze(store, False)
    err = capsys.readouterr().err
    assert err.count("fedlight: warning: tracker mlflow failed at round 3 (MlflowException: (sqlite3.Operational"
                     "Error) ") == 1, err[-2000:]  # the cause, not SQLAlchemy's hint about its session
    assert "SQLAlchemy database error" not in err and "sqlalchemy.exc" not in err, err[-2000:]  # MLflow's log
    assert [r["round"] for r in _rows(out)] == [1, 2, 3, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trackers"]["mlflow"]["missed_rounds"] == "3-4"
    run_id = summary["trackers"]["mlflow"]["id"]
    _assert_history(MlflowClient(mlflow_store), run_id, _rows(out)[:2])


def test_a_tracker_that_failed_mid_run_ends_its_mlflow_run_failed(mlflow_store, tmp_path, monkeypatch, capsys):
    import mlflow

    from fedlight.run.tracker_entries import parse
    from fedlight.run.trackers import Trackers

    out = tmp_path / "run"
    out.mkdir()
    trackers = Trackers(parse("mlflow")[1], out, {"algorithm": "fedavg"}, "loop: {rounds: 2}\n")
    trackers.start()
    logger = trackers.loggers["mlflow"]

    def lost(*args, **kwargs):
        raise OSError("the store went away")

    monkeypatch.setattr(logger, "log_metrics", lost)
    trackers.log_round({"round": 1, "train_loss": 1.0})
    assert trackers.report()["mlflow"]["missed_rounds"] == "1"
    trackers.close()
    assert "tracker mlflow failed at round 1 (OSError: the store went away)" in capsys.readouterr().err
    assert mlflow.get_run(logger.run_id).info.status == "FAILED"  # was KILLED, as for a stopped run


def _settled(path: Path, quiet_s: float = 1.0, limit_s: float = 30.0) -> None:
    """Wait until ``path`` has not changed for ``quiet_s`` (its writer is done)."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        now = path.stat().st_size, path.stat().st_mtime_ns
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)


def test_wandb_offline_run_files_hold_the_history_after_a_kill_and_a_move(tmp_path, monkeypatch):
    """Issue 50: W&B buffers its offline file, so a SIGKILL lost rounds that trackers.json counted as sent, and the
    resume sent only the later ones (W&B held rounds 1, 2 and 6 of 6). The resume now sends what the files lack; the
    files/ links W&B makes are relative, so the run directory can move."""
    pytest.importorskip("wandb")
    from fedlight.run import wandb_files

    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    out = tmp_path / "run"
    args = ["--loop.rounds", "3", "--loop.save_every", "1", "--loggers", "wandb", "--resume", "auto"]
    killed = _cli(out, *args, env={**env, "FEDLIGHT_FAULT": "train@3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert json.loads((out / "trackers.json").read_text())["wandb"]["logged"] == 2  # accepted by W&B
    (segment,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    _settled(segment)  # W&B's service, orphaned, flushes what it buffered: a kill of the job's whole process group
    segment.write_bytes(segment.read_bytes()[:7])  # (its service too) leaves its header only, as seen in the trial
    assert main(["fit", "--config", TINY, "--out_dir", str(out), *args]) == 0
    assert not (out / "tb").exists()  # only what was asked for
    moved = tmp_path / "moved"
    out.rename(moved)
    run_id = json.loads((moved / "summary.json").read_text())["trackers"]["wandb"]["id"]
    history, config, tags = {}, {}, []
    for f in wandb_files.run_files(moved, run_id):  # the killed segment's file, then the resumed one's
        for r in wandb_files.records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                item = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
                history[item["trainer/global_step"]] = item
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "run":
                tags = list(r.run.tags)
    rows = _rows(moved)
    assert sorted(history) == [1, 2, 3], sorted(history)  # the summary figures come with step 3: not a 4th row
    for row in rows:
        numbers = metrics_of(row)
        assert {k: history[row["round"]][k] for k in numbers} == numbers
    assert config["loop"]["rounds"] == 3 and config["model"]["class_path"] == "fedlight.models.MLP"
    assert "algorithm:scaffold" in tags and "seed:0" in tags
    run_dir = wandb_files.run_files(moved, run_id)[-1].parent
    assert {p.name for p in (run_dir / "files").iterdir() if p.exists()} >= {"config.yaml", "summary.json",
                                                                            "final_model.pt"}  # links resolve
    summary = json.loads((moved / "summary.json").read_text())
    assert run_dir.name.endswith(run_id) and summary["trackers"]["wandb"]["missed_rounds"] is None


def test_reproduce_of_a_2x2_table_gives_4_mlflow_runs_tagged_with_their_cells(mlflow_store, tmp_path, monkeypatch):
    import mlflow

    spec = {"title": "2x2", "base": TINY, "metric": "final_test_acc",
            "rows": {"fedavg": {"algorithm": {"class_path": "fedlight.algorithms.FedAvg"}},
                     "scaffold": {"algorithm": {"class_path": "fedlight.algorithms.SCAFFOLD"}}},
            "columns": {"lr05": {"loop.lr": 0.05}, "lr1": {"loop.lr": 0.1}}}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(spec))

    def fit_here(children, cmd, stdout, stderr, env):  # each cell's `fedlight fit` in this process (one import)
        return main(cmd[3:])

    monkeypatch.setattr(runner.Children, "call", fit_here)
    assert main(["reproduce", str(tmp_path / "grid.yaml"), "--shrink", "rounds=1", "--out", str(tmp_path / "out"),
                 "--fit-args", "--loggers mlflow"]) == 0
    runs = mlflow.search_runs(experiment_names=["fedlight"], output_format="list")
    cells = {(r.data.tags["table"], r.data.tags["row"], r.data.tags["column"], r.data.tags["seed"]) for r in runs}
    assert len(runs) == 4 and cells == {("grid", r, c, "0") for r in ("fedavg", "scaffold") for c in ("lr05", "lr1")}
    for r in runs:
        assert r.data.params["loop.lr"] == {"lr05": "0.05", "lr1": "0.1"}[r.data.tags["column"]]
        assert r.data.tags["algorithm"] == r.data.tags["row"]


def test_sigterm_then_resume_continues_the_csv_logger_run_once_per_round(tmp_path):
    """SIGTERM in round 3 (checkpoints every 2 rounds): the run stops after round 3 with its checkpoint and the tracker
    holding rounds 1-3; the resume logs round 4 only, in the same CSVLogger version folder."""
    import csv

    out, ready = tmp_path / "run", tmp_path / "ready"
    args = ["--loop.rounds", "4", "--loop.save_every", "2", "--loggers", "csv", "--resume", "auto"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "FEDLIGHT_FAULT": "train@3:pause", "FEDLIGHT_FAULT_READY": str(ready)}
    proc = subprocess.Popen([sys.executable, "-m", "fedlight.config.cli", "fit", "--config", TINY, "--out_dir",
                             str(out), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert json.loads((out / "trackers.json").read_text())["csv"] == {"id": 0, "logged": 3}
    assert main(["fit", "--config", TINY, "--out_dir", str(out), *args]) == 0
    with open(out / "csv" / "version_0" / "metrics.csv") as f:
        logged = [r for r in csv.DictReader(f) if r["train_loss"]]
    rows = _rows(out)
    assert [int(r["step"]) for r in logged] == [1, 2, 3, 4]
    assert [float(r["train_loss"]) for r in logged] == [row["train_loss"] for row in rows]
    hparams = yaml.safe_load((out / "csv" / "version_0" / "hparams.yaml").read_text())
    assert hparams["loop.rounds"] == 4 and hparams["fedlight.algorithm"] == "scaffold"
