"""What the plots say: the report's loss panel survives a diverging rule; landscape titles name the run."""

import json
from pathlib import Path

import yaml

from fedlight.lab import report


def _run(path: Path, losses: list[float], algorithm: str = "FedSAM") -> Path:
    path.mkdir(parents=True)
    rows = [{"round": r + 1, "train_loss": loss, "test_acc": 0.5} for r, loss in enumerate(losses)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"class_path": f"fedlight.algorithms.{algorithm}"}}))
    return path


def test_report_loss_panel_is_logarithmic(tmp_path):
    good = _run(tmp_path / "fedsam", [2.0, 1.0, 0.5, 0.25])
    diverged = _run(tmp_path / "fedadamw", [2.0, 90.0, 1e4, 1e6], "FedAdamW")
    fig = report.curves_figure({"fedsam": [good], "fedadamw": [diverged]}, "t")
    acc, loss = fig.axes[:2]
    assert loss.get_yscale() == "log" and acc.get_yscale() == "linear"
    assert "log" in loss.get_ylabel()
    report.plot_curves({"fedsam": [good]}, tmp_path / "out" / "curves.png")
    assert (tmp_path / "out" / "curves.png").stat().st_size > 0


def test_report_loss_panel_stays_linear_for_non_positive_losses(tmp_path):
    fig = report.curves_figure({"neg": [_run(tmp_path / "neg", [0.5, -0.5, -1.0])]})
    assert fig.axes[1].get_yscale() == "linear"


TINY = """
seed: 0
model: {class_path: fedlight.models.MLP, init_args: {in_features: 20, hidden: [8], num_classes: 4}}
data:
  class_path: fedlight.data.Synthetic
  init_args: {num_clients: 4, dim: 20, num_classes: 4, samples_per_client: 20, batch_size: 10}
algorithm: {class_path: fedlight.algorithms.FedSAM, init_args: {rho: 0.05}}
loop: {rounds: 1, clients_per_round: 2, local_steps: 1, lr: 0.05, progress: false}
"""


def test_landscape_titles_name_algorithm_and_run(tmp_path):
    from fedlight.config.cli import main
    from fedlight.lab import landscape_run

    (tmp_path / "tiny.yaml").write_text(TINY)
    run_dir = tmp_path / "my_sam_run"
    assert main(["fit", "--config", str(tmp_path / "tiny.yaml"), "--out_dir", str(run_dir), "--accelerator",
                 "cpu"]) == 0
    res = landscape_run.run_landscape(run_dir, dims=2, points=3, device="cpu", tensorboard=False)
    assert len(res["titles"]) == 2
    for title in res["titles"]:
        assert "FedSAM" in title and "my_sam_run" in title and "round 1" in title and "MLP" in title
