"""What the plots say: the report's loss panel survives a diverging rule; extra panels show a rule's per-round
diagnostics (``--curves``, a spec's ``curves:``); landscape titles name the run."""

import json
from pathlib import Path

import pytest
import yaml

from fedlight.config.cli import main
from fedlight.errors import ConfigError
from fedlight.lab.tables import report_plot


def _run(path: Path, losses: list[float], algorithm: str = "FedSAM", **per_round: list) -> Path:
    """A hand-made run; ``per_round``: more keys of metrics.jsonl by name, with ``/`` as ``__``."""
    path.mkdir(parents=True)
    rows = [{"round": r + 1, "train_loss": loss, "test_acc": 0.5} |
            {k.replace("__", "/"): v[r] for k, v in per_round.items() if v[r] is not None}
            for r, loss in enumerate(losses)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"class_path": f"fedlight.algorithms.{algorithm}"}}))
    return path


def test_report_loss_panel_is_logarithmic(tmp_path):
    good = _run(tmp_path / "fedsam", [2.0, 1.0, 0.5, 0.25])
    diverged = _run(tmp_path / "fedadamw", [2.0, 90.0, 1e4, 1e6], "FedAdamW")
    fig = report_plot.curves_figure({"fedsam": [good], "fedadamw": [diverged]}, "t")
    acc, loss = fig.axes[:2]
    assert loss.get_yscale() == "log" and acc.get_yscale() == "linear"
    assert "log" in loss.get_ylabel()
    report_plot.plot_curves({"fedsam": [good]}, tmp_path / "out" / "curves.png")
    assert (tmp_path / "out" / "curves.png").stat().st_size > 0


def test_report_loss_panel_stays_linear_for_non_positive_losses(tmp_path):
    fig = report_plot.curves_figure({"neg": [_run(tmp_path / "neg", [0.5, -0.5, -1.0])]})
    assert fig.axes[1].get_yscale() == "linear"


def _momentum_runs(tmp_path: Path) -> list[Path]:
    """Two seeds of a FedCM-client cell: round 2 of the second has no variance (a mean over one run there)."""
    return [_run(tmp_path / "seed0", [2.0, 1.0, 0.5], "FedCMClient", server__momentum_variance=[1e-4, 0.02, 0.5],
                 server__avg_momentum_norm=[1.0, 2.0, 3.0]),
            _run(tmp_path / "seed1", [2.0, 1.5, 1.0], "FedCMClient", server__momentum_variance=[3e-4, None, 0.3],
                 server__avg_momentum_norm=[2.0, 2.0, -1.0])]


def test_extra_panels_are_the_per_round_means_of_their_keys(tmp_path):
    runs = _momentum_runs(tmp_path)
    keys = ["server/momentum_variance", "server/avg_momentum_norm"]
    fig = report_plot.curves_figure({"beta_0.9": runs}, "t", keys)
    assert len(fig.axes) == 2 + len(keys)
    var, norm = fig.axes[2:]
    (line,) = var.get_lines()
    assert list(line.get_xdata()) == [1, 2, 3]
    assert list(line.get_ydata()) == pytest.approx([2e-4, 0.02, 0.4])
    assert list(norm.get_lines()[0].get_ydata()) == pytest.approx([1.5, 2.0, 1.0])
    assert var.get_yscale() == "log" and var.get_ylabel().startswith("server/momentum_variance")  # 3.3 decades
    assert norm.get_yscale() == "linear" and norm.get_ylabel() == "server/avg_momentum_norm"
    fig = report_plot.curves_figure({"beta_0.9": runs}, "t", keys[:1])  # an odd count: no empty fourth panel
    assert len(fig.axes) == 3
    assert len(report_plot.curves_figure({"beta_0.9": runs}).axes) == 2


def test_an_unknown_curve_key_names_it_and_the_keys_there_are(tmp_path, capsys):
    runs = _momentum_runs(tmp_path)
    with pytest.raises(ConfigError, match=r"`server/momentum_varaince`.*server/avg_momentum_norm, "
                                          r"server/momentum_variance, test_acc, train_loss$"):
        report_plot.check_curve_keys(runs, ["server/avg_momentum_norm", "server/momentum_varaince"], "--curves")
    out = tmp_path / "rep"
    assert main(["report", *map(str, runs), "--out", str(out), "--curves", "server/momentum_varaince"]) == 2
    err = capsys.readouterr().err
    assert "server/momentum_varaince" in err and "server/momentum_variance" in err
    assert not out.exists()  # refused before anything is written
    assert main(["report", *map(str, runs), "--out", str(out), "--curves",
                 "server/momentum_variance,server/avg_momentum_norm"]) == 0
    assert (out / "curves.png").stat().st_size > 0
    assert "| seed0 (unfinished) | FedCMClient | 3 | 50.00 | 50.00 (-) |" in (out / "report.md").read_text()


def test_a_spec_with_curves_passes_its_keys_to_the_table_figure(tmp_path, monkeypatch, capsys):
    from fedlight.lab.tables import table_report

    spec = yaml.safe_load((Path(__file__).parent.parent / "recipes" / "tables" / "fedcm_client_beta.yaml").read_text())
    spec = {k: spec[k] for k in ("title", "base", "metric")} | {
        "base": str(Path(__file__).parent.parent / spec["base"]), "columns": {"lr0.01": {}},
        "rows": {"beta_0.9": {"algorithm.init_args.beta": 0.9}}, "curves": ["server/momentum_variance"]}
    path, out = tmp_path / "spec.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(spec))
    for seed in (0, 1):
        run = _run(out / "beta_0.9" / "lr0.01" / f"seed{seed}", [1.0, 0.5], "FedCMClient",
                   server__momentum_variance=[0.1, 0.2])
        (run / "summary.json").write_text(json.dumps({"final_test_acc": 0.5, "rounds_completed": 2}))
        (run / "config.yaml").write_text(yaml.safe_dump({"loop": {"rounds": 2}}))
    seen = []
    monkeypatch.setattr(table_report, "plot_curves", lambda groups, p, title, keys: seen.append((groups, keys)))
    assert main(["reproduce", str(path), "--seeds", "2", "--out", str(out), "--table-only"]) == 0
    assert [(len(g["beta_0.9"]), k) for g, k in seen] == [(2, ["server/momentum_variance"])]

    # A misspelt key: the runs are done by now, so the table is written, the key left out with a warning naming it.
    path.write_text(yaml.safe_dump(spec | {"curves": ["server/momentum", "server/momentum_variance"]}))
    (out / "table.md").unlink()
    seen.clear()
    assert main(["reproduce", str(path), "--seeds", "2", "--out", str(out), "--table-only"]) == 0
    assert (out / "table.md").exists() and [k for _, k in seen] == [["server/momentum_variance"]]
    assert "warning: table spec" in capsys.readouterr().err.replace("\n", " ")
    path.write_text(yaml.safe_dump(spec | {"curves": "server/momentum_variance"}))
    with pytest.raises(ConfigError, match="`curves` must be a list"):
        from fedlight.lab.tables import spec as table_spec
        table_spec.load_spec(path)


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
    from fedlight.lab.flatness import run as landscape_run

    (tmp_path / "tiny.yaml").write_text(TINY)
    run_dir = tmp_path / "my_sam_run"
    assert main(["fit", "--config", str(tmp_path / "tiny.yaml"), "--out_dir", str(run_dir), "--accelerator",
                 "cpu"]) == 0
    res = landscape_run.run_landscape(run_dir, dims=2, points=3, device="cpu", tensorboard=False)
    assert len(res["titles"]) == 2
    for title in res["titles"]:
        assert "FedSAM" in title and "my_sam_run" in title and "round 1" in title and "MLP" in title
