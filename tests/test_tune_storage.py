"""Every storage fault of ``fedlight tune`` is one line with exit 74 or 2 (issue 68, item 5): a read-only storage
(also of a finished study, also with ``--report-only``), a locked one, a missing one. No trial is run here."""

import contextlib
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml

optuna = pytest.importorskip("optuna")

from fedlight.config.cli import main  # noqa: E402
from fedlight.lab.tables import runner, studies  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPEC = {
    "title": "tiny tune", "base": "recipes/quickstart.yaml", "metric": "best_test_acc",
    "overrides": {"loop.local_steps": 2, "data.init_args.num_clients": 10, "loop.clients_per_round": 2},
    "rows": {"fedavg": {"algorithm": {"class_path": "fedlight.algorithms.FedAvg"}}},
    "tune": {"trials": 1, "rounds": 2, "objective": "best_test_acc", "sampler": {"name": "grid", "seed": 0},
             "pruner": "none", "space": {"*": {"loop.lr": {"choices": [0.05]}}}},
}


@pytest.fixture
def finished(tmp_path, monkeypatch):
    """A finished study (its one trial told complete) in ``out/study.db``; trials are never run here."""
    from fedlight.lab.tables.spec import load_spec
    from fedlight.lab.tuning import cli as tune_cmd
    from fedlight.lab.tuning import space as tune_space

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    spec = load_spec(tmp_path / "spec.yaml")
    job = tune_cmd.Job(spec, tmp_path / "spec.yaml", tune_space.parse(spec, "spec"), tmp_path / "out",
                       f"sqlite:///{tmp_path / 'out' / 'study.db'}", "spec", ["fedavg"], None, [])
    job.tell(job.next(), 42.0, optuna.trial.TrialState.COMPLETE)
    called = []
    monkeypatch.setattr(runner.Children, "call", lambda *a, **k: called.append(a))
    yield tmp_path
    assert not called


@contextlib.contextmanager
def _read_only(folder: Path):
    """``folder`` seen through a read-only view (a read-only bind mount as root, whom file modes do not stop)."""
    view = folder.with_name(folder.name + "_ro")
    view.mkdir()
    if os.geteuid() != 0:
        view.rmdir()
        view.symlink_to(folder)
        modes = {p: p.stat().st_mode for p in [folder, *folder.iterdir()]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield view
        finally:
            for p, m in modes.items():
                p.chmod(m)
        return
    ok = subprocess.run(["mount", "--bind", str(folder), str(view)], capture_output=True).returncode == 0 and \
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True).returncode == 0
    try:
        if not ok:
            pytest.skip("needs a read-only bind mount (root in a container that may mount)")
        yield view
    finally:
        subprocess.run(["umount", "-l", str(view)], capture_output=True)  # lazy: the storage may still be open


def _one_line(capsys, argv, status):
    assert main(argv) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("extra", [[], ["--report-only"]])
def test_a_read_only_storage_is_one_line(extra, finished, capsys):
    with _read_only(finished / "out") as view:
        before = (view / "study.db").read_bytes()
        line = _one_line(capsys, ["tune", "spec.yaml", "--out", str(view), *extra], 74)
        if extra:  # reading the finished study works; its report cannot be written there
            assert line.startswith(f"fedlight tune: error: cannot write {view}/tune"), line
        else:
            assert line.startswith(f"fedlight tune: error: the study storage sqlite:///{view / 'study.db'} cannot be "
                                   "used (attempt to write a readonly database)"), line
        assert (view / "study.db").read_bytes() == before


def test_a_locked_storage_is_one_line(finished, capsys, monkeypatch):
    monkeypatch.setattr(studies, "BUSY_TIMEOUT_S", 0.2)
    holder = sqlite3.connect(finished / "out" / "study.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        line = _one_line(capsys, ["tune", "spec.yaml", "--out", "out"], 74)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert line.startswith(f"fedlight tune: error: the study storage sqlite:///{finished / 'out' / 'study.db'} "
                           "cannot be used (database is locked); make it writable, or wait until"), line
    assert main(["tune", "spec.yaml", "--out", "out"]) == 0  # released: the finished study reports


def test_a_missing_storage_is_one_line(finished, capsys):
    line = _one_line(capsys, ["tune", "spec.yaml", "--out", "elsewhere", "--report-only"], 2)
    assert "there is no study storage there" in line and not Path("elsewhere").exists()
    line = _one_line(capsys, ["tune", "spec.yaml", "--out", "out", "--storage", "sqlite:////proc/no/study.db"], 2)
    assert "cannot be opened" in line
