"""``fedlight tune``'s report of a best value at the edge of its space: within 5 % of a bound of its range (on the
log scale where the range is log), named in ``tune.md`` and on the console, not for a best value inside its range.

The studies are made with Optuna directly (trials added with their values, no runs) and reported with
``fedlight tune --report-only``, which runs nothing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

optuna = pytest.importorskip("optuna")

from fedlight.config.cli import main  # noqa: E402
from fedlight.lab.tuning import report as tune_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LR = {"low": 0.01, "high": 1.0, "log": True}
SERVER_LR = {"low": 0.5, "high": 1.5}
SPEC = {
    "title": "tiny tune", "base": "recipes/quickstart.yaml", "metric": "best_test_acc",
    "rows": {"fedavg": {"algorithm": {"class_path": "fedlight.algorithms.FedAvg"}}},
    "tune": {"trials": 3, "rounds": 2, "objective": "best_test_acc",
             "space": {"*": {"loop.lr": LR, "algorithm.init_args.server_lr": SERVER_LR}}},
}


def _make_study(spec_path: Path, out: Path) -> None:
    """The row's study with the protocol ``fedlight tune`` records, no trial run (``--report-only`` makes none)."""
    from fedlight.lab.tables.spec import load_spec
    from fedlight.lab.tuning import cli as tune_cli
    from fedlight.lab.tuning import space as tune_space
    from fedlight.lab.tuning import study as tune_study

    spec = load_spec(spec_path)
    tune_cli.Job(spec, spec_path, tune_space.parse(spec, str(spec_path)), out, tune_study.storage_url(None, out),
                 spec_path.stem, list(spec["rows"]), None, [], create=True)


def _report(tmp_path, monkeypatch, capsys, trials: list[tuple[float, float, float]]) -> tuple[str, str, str]:
    """tune.md, stdout and stderr of ``--report-only`` on a study holding ``trials`` (lr, server_lr, objective)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    Path("spec.yaml").write_text(yaml.safe_dump(SPEC, sort_keys=False))  # the space in its order
    args = ["tune", "spec.yaml", "--out", "out", "--report-only"]
    _make_study(Path("spec.yaml"), Path("out"))  # the (empty) study with its protocol, as `fedlight tune` makes it
    study = optuna.load_study(study_name="spec/fedavg", storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")
    dists = {"loop.lr": optuna.distributions.FloatDistribution(0.01, 1.0, log=True),
             "algorithm.init_args.server_lr": optuna.distributions.FloatDistribution(0.5, 1.5)}
    for lr, server_lr, value in trials:
        study.add_trial(optuna.trial.create_trial(
            params={"loop.lr": lr, "algorithm.init_args.server_lr": server_lr}, distributions=dists, value=value))
    capsys.readouterr()
    assert main(args) == 0
    out, err = capsys.readouterr()
    return (tmp_path / "out" / "tune.md").read_text(), out, err


def test_a_best_value_near_a_bound_is_named_in_tune_md_and_on_the_console(tmp_path, monkeypatch, capsys):
    # the best (80.0): lr 0.95 on [0.01, 1] log is ln(95)/ln(100) = 98.9 % of the way up; server_lr 0.52 on [0.5,
    # 1.5] is 2.0 % up. The other trial (lr 0.1, the middle on the log scale) is worse, so it is not read.
    text, out, err = _report(tmp_path, monkeypatch, capsys, [(0.1, 1.0, 70.0), (0.95, 0.52, 80.0)])
    assert 1 - math.log(95) / math.log(100) == pytest.approx(0.0111, abs=1e-4)
    lr = "loop.lr = 0.95 lies 1.1% of its range from its high bound 1 (log scale)"
    server = "algorithm.init_args.server_lr = 0.52 lies 2.0% of its range from its low bound 0.5"
    assert "**Best at the edge of the space**" in text and f"- fedavg: {lr}; {server}" in text
    assert f"- fedavg: {lr}; {server}" in out  # tune.md as printed
    assert err.splitlines() == [f"fedlight tune: fedavg: best at the edge of its space: {lr}; {server}; widen that "
                                "range and tune again with a new --out (docs/tuning.md)"]


def test_a_best_value_inside_its_range_is_not_named(tmp_path, monkeypatch, capsys):
    # the best (80.0) at lr 0.1 (the middle, log scale) and server_lr 1.0 (the middle); the worse trial is at the edge
    text, out, err = _report(tmp_path, monkeypatch, capsys, [(0.1, 1.0, 80.0), (0.99, 0.5, 70.0)])
    assert "Best at the edge" not in text and "edge" not in err
    assert "Every best value of a range lies inside it (more than 5% of the range from each bound" in text


@pytest.mark.parametrize("value, dist, pos", [
    (0.289, {"low": 0.003, "high": 0.3, "log": True}, math.log(0.289 / 0.003) / math.log(100)),  # 0.992: FedWMSAM's
    (0.233, {"low": 0.001, "high": 0.3, "log": True}, math.log(233) / math.log(300)),  # 0.956: first study's rho
    (0.38, {"low": 0.01, "high": 0.9}, 0.37 / 0.89),  # its alpha, linear: inside
    (3, {"low": 1, "high": 5, "int": True}, 0.5),
    ("sgd", {"choices": ["sgd", "adam"]}, None),
])
def test_position_in_the_range(value, dist, pos):
    got = tune_report.position(value, dist)
    assert got == pytest.approx(pos) if pos is not None else got is None


def test_a_report_read_while_the_last_trial_ran_is_written_again_once_the_study_is_spent(tmp_path, monkeypatch,
                                                                                          capsys):
    """Two workers share a study: one reads it while the other's last trial runs, and its "not finished" report can
    land after the other's "budget spent" one. Here the last trial finishes between the read and the write (as the
    other worker would): ``tune.md`` must end saying the budget is spent, with that trial complete."""
    dists = {"loop.lr": optuna.distributions.FloatDistribution(0.01, 1.0, log=True),
             "algorithm.init_args.server_lr": optuna.distributions.FloatDistribution(0.5, 1.5)}
    params = {"loop.lr": 0.1, "algorithm.init_args.server_lr": 1.0}
    done = [optuna.trial.create_trial(params=params, distributions=dists, value=v) for v in (0.5, 0.6)]
    running = optuna.trial.create_trial(params=params, distributions=dists,
                                        state=optuna.trial.TrialState.RUNNING)
    written, finish = [], []
    original = tune_report._write

    def racing(job, command):  # the other worker ends its trial right after this one has read the study
        result = original(job, command)
        written.append(result[1])
        if finish:
            study = job.studies["fedavg"]
            trial = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.RUNNING][0]
            study._storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.COMPLETE, [0.7])
            finish.clear()
        return result

    monkeypatch.setattr(tune_report, "_write", racing)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    Path("spec.yaml").write_text(yaml.safe_dump(SPEC, sort_keys=False))
    _make_study(Path("spec.yaml"), Path("out"))
    study = optuna.load_study(study_name="spec/fedavg", storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")
    for t in (*done, running):
        study.add_trial(t)
    finish.append(True)
    assert main(["tune", "spec.yaml", "--out", "out", "--report-only"]) == 0
    assert written == [False, True]  # read unspent, written again once spent
    text = (tmp_path / "out" / "tune.md").read_text()
    assert "budget spent: every trial finished" in text and "(last report)" not in text
