"""The headline metric of any task flows into summary.json, `fedlight report` and table specs."""

from __future__ import annotations

import json

import pytest

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.data import SyntheticRegression
from fedlight.errors import ConfigError
from fedlight.lab.tables import report
from fedlight.lab.tables import spec as table_spec
from fedlight.models import MLP


@pytest.fixture(scope="module")
def regression_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reg") / "run"
    fedlight.fit(MLP(in_features=4, hidden=[8], num_classes=1),
                 SyntheticRegression(num_clients=4, dim=4, samples_per_client=20, batch_size=5),
                 loop=LoopConfig(rounds=4, clients_per_round=2, local_steps=3, lr=0.05, targets=[10.0, 0.0],
                                 progress=False), out_dir=str(out))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, [r["test_mse"] for r in rows]


def test_summary_and_table_metrics_of_a_lower_is_better_headline(regression_run):
    run, mse = regression_run
    s = json.loads((run / "summary.json").read_text())
    assert s["headline"] == {"metric": "test_mse", "higher_is_better": False}
    assert s["best_test_mse"] == min(mse) and s["best_round"] == 1 + mse.index(min(mse))
    assert s["rounds_to_target"] == {"10.0": next(i + 1 for i, v in enumerate(mse) if v <= 10.0), "0.0": None}
    assert report.metric_value(run, "final_test_mse") == mse[-1]  # not a fraction: no % scaling
    assert report.metric_value(run, "best_test_mse") == min(mse)
    assert report.metric_value(run, "last_test_mse:2") == pytest.approx(sum(mse[-2:]) / 2)
    assert report.metric_value(run, "rounds_to_target:10") == s["rounds_to_target"]["10.0"]
    assert report.metric_value(run, "final_test_r2") == s["final_test_r2"]
    assert report.metric_label("last_test_mse:2") == "mean test mse over the last 2 evaluations"


def test_report_table_uses_the_headline(regression_run):
    run, mse = regression_run
    rows = report.run_rows([run])
    assert rows[0]["metric"] == "test_mse" and rows[0]["final_test_mse"] == mse[-1]
    table = report.markdown_table(rows)
    assert "| final mse | best mse (round) |" in table and f"{mse[-1]:.4g}" in table


def test_a_table_metric_the_task_does_not_report_is_refused_before_any_run(tmp_path):
    spec = {"title": "t", "base": "recipes/quickstart.yaml", "metric": "final_test_mse", "rows": {"a": {}},
            "columns": {"result": {}}}
    with pytest.raises(ConfigError, match=r"test_mse are not reported by the task.*reports test_acc, test_loss"):
        table_spec.check_task_metrics(spec)
    table_spec.check_task_metrics({**spec, "metric": "last_test_acc:5"})  # a metric it reports passes
    regression = {**spec, "base": "recipes/fedavg_mlp_syntheticregression_natural.yaml"}
    table_spec.check_task_metrics({**regression, "metric": "best_test_mse"})
    with pytest.raises(ConfigError, match="test_acc"):
        table_spec.check_task_metrics(regression | {"metric": "final_test_acc"})
    with pytest.raises(ConfigError, match="unknown metric"):
        report.check_metric("final_mse")


def test_a_metric_direction_comes_from_the_task_only(regression_run, tmp_path):
    """summary.json records every reported metric's direction as the task states it (R² up, MSE/MAE/loss down);
    `fedlight report` reads a best_ value from the curve by that record, and refuses one the run did not record
    instead of guessing from the name."""
    import shutil

    from fedlight.tasks import Regression

    run, _ = regression_run
    s = json.loads((run / "summary.json").read_text())
    assert s["metric_directions"] == Regression().directions() == {
        "test_mse": False, "test_mae": False, "test_r2": True, "test_loss": False}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert report.metric_value(run, "best_test_r2") == max(r["test_r2"] for r in rows)
    assert report.metric_value(run, "best_test_mae") == min(r["test_mae"] for r in rows)
    old = tmp_path / "old"
    shutil.copytree(run, old)
    from fedlight.run import side_files

    old_summary = {k: v for k, v in s.items() if k not in ("metric_directions", side_files.KEY)}
    (old / "summary.json").write_text(side_files.seal_summary(old_summary))  # as written, without the record
    assert report.metric_value(old, "best_test_mse") == min(r["test_mse"] for r in rows)  # the headline's own
    with pytest.raises(ConfigError, match="does not record whether higher test_r2 is better"):
        report.metric_value(old, "best_test_r2")


def test_a_recipe_whose_model_is_a_lightningmodule_leaves_its_metrics_to_the_run_and_a_plain_one_imports_no_lightning(
        tmp_path):
    """A LightningModule's ``test_step`` decides its metrics, so the spec check lets them through (``None``); the
    check tells a LightningModule by its bases, so a table of fedlight's own models never imports Lightning (the
    import is seconds at every ``fedlight reproduce --status``)."""
    import subprocess
    import sys

    lit = tmp_path / "lit.yaml"
    lit.write_text("model: {class_path: lit.LitMLP}\ndata: {class_path: fedlight.data.Synthetic}\n")
    assert table_spec.task_metrics(lit) is None
    assert table_spec._is_lightning_module("lit.LitMLP") and not table_spec._is_lightning_module("fedlight.models.MLP")
    code = ("import sys; from fedlight.lab.tables import spec as r; "
            "assert not r._is_lightning_module('fedlight.models.MLP'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"
