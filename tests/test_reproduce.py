"""``fedlight reproduce`` and ``fedlight report``: metrics from run records, the table, skipping/resuming, plots.

The end-to-end test shrinks a two-cell table over ``recipes/quickstart.yaml`` (Synthetic data, no files) to two
rounds and checks that every number in ``table.csv`` is the one in the runs' ``summary.json``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedlight.config.cli import main
from fedlight.errors import ConfigError
from fedlight.lab.tables import report, runner, table_report
from fedlight.lab.tables import spec as table_spec
from fedlight.run.files import rounds_to_target

ROOT = Path(__file__).resolve().parent.parent


def fake_run(path: Path, accs: list, losses: list | None = None, rounds: int | None = None, **summary) -> Path:
    """A hand-made finished run: metrics.jsonl (test_acc None = not evaluated that round), config.yaml, summary.json."""
    path.mkdir(parents=True)
    losses = losses or [2.0 / (r + 1) for r in range(len(accs))]
    rows = [{"round": r + 1, "train_loss": loss, "round_time_s": 0.5} | ({} if a is None else {"test_acc": a})
            for r, (a, loss) in enumerate(zip(accs, losses))]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"round": 9, "tor')
    (path / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"class_path": "fedlight.algorithms.FedSAM"},
                                                      "loop": {"rounds": rounds or len(accs)}}))
    evals = [a for a in accs if a is not None]
    (path / "summary.json").write_text(json.dumps({
        "final_test_acc": evals[-1], "best_test_acc": max(evals), "best_round": 1 + accs.index(max(evals)),
        "rounds_completed": len(accs), "final_train_loss": losses[-1], "seconds_per_round": 0.5,
        "versions": {"git_revision": "abc", "cuda_device": None}} | summary))
    return path


def test_rounds_to_target_on_a_hand_made_curve(tmp_path):
    # round:     1     2     3     4     5     6      (round 2 was not evaluated; round 4 dips back below 0.5)
    accs = [0.10, None, 0.50, 0.45, 0.72, 0.80]
    run = fake_run(tmp_path / "run", accs)
    curve = report.read_curve(run)  # the torn last line of an interrupted write is skipped
    assert [r["round"] for r in curve] == [1, 2, 3, 4, 5, 6]
    assert rounds_to_target(curve, 0.5) == 3  # reached exactly at round 3 (>=), the later dip does not matter
    assert report.metric_value(run, "rounds_to_target:0.5") == 3
    assert report.metric_value(run, "rounds_to_target:0.7") == 5
    assert report.metric_value(run, "rounds_to_target:70") == 5  # a target in percent means the same
    assert report.metric_value(run, "rounds_to_target:0.1") == 1
    assert report.metric_value(run, "rounds_to_target:0.81") is None  # never reached
    assert report.metric_value(run, "final_test_acc") == pytest.approx(80.0)  # accuracies in %
    assert report.metric_value(run, "best_test_acc") == pytest.approx(80.0)
    assert report.metric_value(run, "seconds_per_round") == 0.5
    assert report.metric_value(run, "final_train_loss") == pytest.approx(2.0 / 6)
    with pytest.raises(ConfigError, match="unknown metric"):
        report.metric_value(run, "final_acc")
    # mean over the last k evaluations (round 2 has none): (0.45 + 0.72 + 0.80) / 3, then all four
    assert report.metric_value(run, "last_test_acc:3") == pytest.approx(100 * (0.45 + 0.72 + 0.80) / 3)
    assert report.metric_value(run, "last_test_acc:10") == pytest.approx(100 * (0.10 + 0.50 + 0.45 + 0.72 + 0.80) / 5)
    with pytest.raises(ConfigError, match="last_test_acc:10"):
        report.metric_value(run, "last_test_acc:x")


def test_per_round_keys_final_last_and_variance_on_a_hand_made_curve(tmp_path):
    """``final_<key>``, ``last_<key>:<k>`` and ``var_<key>:<k>`` of any per-round key (the FedCM-client table's loss
    variance and momentum columns): values by hand from the curve, population variance over the last k rounds."""
    run = fake_run(tmp_path / "run", [0.1, 0.2, 0.3, 0.4], losses=[4.0, 1.0, 2.0, 6.0])
    assert report.metric_value(run, "var_train_loss:3") == pytest.approx(((1 - 3) ** 2 + (2 - 3) ** 2 + 3 ** 2) / 3)
    assert report.metric_value(run, "var_train_loss:10") == pytest.approx(3.6875)  # all four: mean 3.25
    assert report.metric_value(run, "last_train_loss:2") == pytest.approx(4.0)
    with pytest.raises(ConfigError, match="unknown metric `final_server/momentum_variance`: no round"):
        report.metric_value(run, "final_server/momentum_variance")  # a rule diagnostic this run does not log
    assert report.metric_label("var_train_loss:100") == "variance of train_loss over the last 100 rounds"
    assert report.stats("var_train_loss:100", [0.00123, 0.00456])["text"] == "0.00290 ± 0.00235"
    for bad in ("var_train_loss", "last_train_loss:0", "final_train_loss_x:3", "final_mse"):
        with pytest.raises(ConfigError, match="var_train_loss:100|unknown metric"):
            report.metric_value(run, bad)


def test_stats_and_paper_numbers():
    s = report.stats("final_test_acc", [80.0, 82.0, 84.0])
    assert (s["mean"], s["n"]) == (82.0, 3) and math.isclose(s["std"], 2.0) and s["text"] == "82.00 ± 2.00"
    s = report.stats("rounds_to_target:0.7", [100, None, 120])
    assert s["mean"] == 110 and s["text"] == "110 ± 14 (2/3 reached)"
    assert report.stats("rounds_to_target:0.7", [None, None])["text"] == "not reached"
    assert report.stats("final_test_acc", [81.5, "missing"])["text"] == "81.50 [1/2 seeds]"
    assert report.stats("final_test_acc", ["missing"])["text"] == "not run"
    assert table_report.number("66.04 ± 0.11") == 66.04 and table_report.number(84.64) == 84.64
    assert table_report.number("83.75 (best of 3)") == 83.75 and table_report.number("not reached") is None


def test_gap_to_the_baseline_row_is_paired_by_seed_with_the_papers_sign():
    """`baseline: fedavg`: each cell's gap to FedAvg in its column, over the seeds both finished, next to the
    paper's gap and whether the signs agree (table.md section and four table.csv columns)."""
    spec = {"metric": "final_test_acc", "also": ["last_test_acc:10", "seconds_per_round"], "baseline": "fedavg",
            "paper": {"fedavg": {"a": 82.26}, "fedwmsam": {"a": "84.64"}, "fedcm": {"a": 73.33}}}

    def cell(row, final, last10, sec=(1.0, 1.0, 1.0)):
        c = table_spec.Cell(row, "a", "final_test_acc", {}, f"{row}/a")
        c.values = {"final_test_acc": list(final), "last_test_acc:10": list(last10), "seconds_per_round": list(sec)}
        return c

    cs = [cell("fedavg", [85.0, 85.5, 86.0], [85.4, 85.5, 85.5]),
          cell("fedwmsam", [84.0, 84.5, "missing"], [84.6, 84.4, "missing"], (2.0, 2.0, "missing")),
          cell("fedcm", [79.0, "missing", "missing"], [78.8, "missing", "missing"])]
    gaps = table_report.baseline_gaps(spec, cs)
    g = gaps[("fedwmsam/a", "final_test_acc")]
    assert g["pairs"] == 2 and g["gap"] == pytest.approx(-1.0) and g["paper_gap"] == pytest.approx(2.38)
    assert g["same_sign"] is False
    assert gaps[("fedwmsam/a", "last_test_acc:10")]["gap"] == pytest.approx(-0.95)
    assert gaps[("fedwmsam/a", "last_test_acc:10")]["same_sign"] is False
    assert gaps[("fedwmsam/a", "seconds_per_round")]["same_sign"] is None  # not comparable with an accuracy
    assert gaps[("fedcm/a", "final_test_acc")] | {"digits": 2} == {
        "gap": pytest.approx(-6.0), "pairs": 1, "paper_gap": pytest.approx(-8.93), "same_sign": True, "digits": 2}
    assert gaps[("fedavg/a", "final_test_acc")]["gap"] == 0 and gaps[("fedavg/a", "final_test_acc")]["same_sign"]
    text = "\n".join(table_report.gap_lines(spec, cs, gaps))
    assert "## Gap to fedavg" in text and "| fedwmsam/a | +2.38 | -1.00 ≠ (2) | -0.95 ≠ (2) | +1.000 (2) |" in text
    assert table_report.baseline_gaps({**spec, "baseline": None}, cs) == {}


def test_overrides_become_fit_flags_and_shrink_skips_what_the_data_lacks():
    assert table_spec.flags({"loop.rounds": 2, "algorithm": {"class_path": "X", "init_args": {"rho": 0.1}},
                            "loop.local_epochs": None, "loop.progress": False, "model": "fedlight.models.MLP"}) == [
        "--loop.rounds", "2", "--algorithm", '{"class_path": "X", "init_args": {"rho": 0.1}}',
        "--loop.local_epochs", "null", "--loop.progress", "false", "--model", "fedlight.models.MLP"]
    spec = {"base": "recipes/quickstart.yaml"}
    syn = table_spec.Cell("a", "b", "final_test_acc", {}, "a")
    assert table_spec.shrink_overrides("rounds=2,subset=512,test_subset=256,loop.local_steps=3", spec, syn) == {
        "loop.rounds": 2, "data.init_args.test_subset": 256, "loop.local_steps": 3}  # Synthetic has no `subset`
    fm = table_spec.Cell("a", "b", "final_test_acc", {"data": {"class_path": "fedlight.data.FashionMNIST"}}, "a")
    assert table_spec.shrink_overrides("rounds=2,subset=512", spec, fm) == {"loop.rounds": 2,
                                                                           "data.init_args.subset": 512}
    with pytest.raises(ConfigError, match="key=value"):
        table_spec.shrink_overrides("rounds", spec, syn)


def test_columns_without_overrides_share_their_rows_runs(tmp_path):
    spec = table_spec.load_spec(table_spec.find_spec("fedwmsam_table3"))
    t3 = table_spec.cells(spec)
    fedavg = [c for c in t3 if c.row == "fedavg"]
    assert {c.run_key for c in fedavg} == {"fedavg/to_70"}  # six metrics, one run per seed
    assert [c.metric for c in fedavg] == ["rounds_to_target:0.70", "rounds_to_target:0.72", "rounds_to_target:0.74",
                                          "rounds_to_target:0.76", "rounds_to_target:0.78", "seconds_per_round"]
    runs = runner.plan(spec, t3, [0, 1], tmp_path, None)
    assert len(runs) == 6 * 11 * 2 and len({r.path for r in runs}) == 11 * 2
    t4 = table_spec.cells(table_spec.load_spec(table_spec.find_spec("fednsam_table4")))
    t4_columns = ("p0.02", "p0.05", "p0.1", "dir0.1", "dir0.3")
    assert {c.run_key for c in t4 if c.row == "fednsam"} == {f"fednsam/{col}" for col in t4_columns}
    t1 = table_spec.cells(table_spec.load_spec(table_spec.find_spec("fedwmsam_table1")))
    assert len({c.run_key for c in t1}) == len(t1) == 12 * 13  # 12 paper columns + the partition diagnostic


def write_spec(path: Path, mu: float = 0.01) -> Path:
    path.write_text(yaml.safe_dump({
        "title": "Quickstart two-cell table",
        "base": "recipes/quickstart.yaml",
        "metric": "final_test_acc",
        "also": ["rounds_to_target:0.2", "seconds_per_round"],
        "rows": {"fedavg": {"algorithm": {"class_path": "fedlight.algorithms.FedAvg"}},
                 "fedprox": {"algorithm": {"class_path": "fedlight.algorithms.FedProx", "init_args": {"mu": mu}}}},
        "columns": {"synthetic": {}},
        "paper": {"fedavg": {"synthetic": 50.0}, "fedprox": {"synthetic": "51.2 ± 0.3"}},
        "notes": "Synthetic(1, 1) instead of the paper's data.",
    }, sort_keys=False))
    return path


def test_spec_errors_are_one_line(tmp_path):
    spec = yaml.safe_load(write_spec(tmp_path / "s.yaml").read_text())
    for change, msg in [({"rows": {}}, "rows"), ({"metric": "accuracy"}, "unknown metric"),
                        ({"paper": {"fedavg": {"cifar": 1.0}}}, "not in the grid"), ({"colums": {}}, "unknown keys"),
                        ({"baseline": "fedsgd"}, "`baseline` must name a row")]:
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec | change))
        with pytest.raises(ConfigError, match=msg):
            table_spec.load_spec(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="not found"):
        table_spec.find_spec("no_such_table")
    assert table_spec.find_spec("fedwmsam_table1") == ROOT / "recipes" / "tables" / "fedwmsam_table1.yaml"


def test_shrunk_reproduce_table_matches_the_runs(tmp_path, capsys, monkeypatch):
    spec, out = write_spec(tmp_path / "quick.yaml"), tmp_path / "out"
    args = [str(spec), "--shrink", "rounds=2,subset=512,test_subset=128,loop.local_steps=2", "--out", str(out)]
    assert main(["reproduce", *args, "--jobs", "2"]) == 0
    printed = capsys.readouterr().out
    assert "fedavg/synthetic seed0: done" in printed and "fedprox/synthetic seed0: done" in printed
    runs = {c: out / c / "synthetic" / "seed0" for c in ("fedavg", "fedprox")}
    summaries = {c: json.loads((r / "summary.json").read_text()) for c, r in runs.items()}
    assert all(s["rounds_completed"] == 2 for s in summaries.values())
    data = yaml.safe_load((runs["fedavg"] / "config.yaml").read_text())["data"]["init_args"]
    assert data["test_subset"] == 128 and "subset" not in data  # Synthetic takes no `subset`: skipped
    rows = {(r["cell"], r["metric"]): r for r in csv.DictReader((out / "table.csv").open())}
    assert len(rows) == 6
    for cell, paper in (("fedavg", 50.0), ("fedprox", 51.2)):
        r = rows[(f"{cell}/synthetic", "final_test_acc")]
        measured = 100 * summaries[cell]["final_test_acc"]
        assert float(r["mean"]) == pytest.approx(measured, abs=1e-9) and r["n"] == "1" and r["std"] == ""
        assert float(r["difference"]) == pytest.approx(measured - paper, abs=1e-9)
        assert r["run_dir"] == str(out / cell / "synthetic")
        sec = rows[(f"{cell}/synthetic", "seconds_per_round")]
        assert float(sec["mean"]) == pytest.approx(summaries[cell]["seconds_per_round"])
        reach = rows[(f"{cell}/synthetic", "rounds_to_target:0.2")]
        curve = report.read_curve(runs[cell])
        assert json.loads(reach["values"]) == [rounds_to_target(curve, 0.2)]
    md = (out / "table.md").read_text()
    for needle in ("Quickstart two-cell table", "Hardware: CPU", "fedlight revision:", "rounds: 2",
                   "Command: `fedlight reproduce", "--jobs 2", "Synthetic(1, 1) instead", " / 51.2 ± 0.3 |",
                   f"{100 * summaries['fedavg']['final_test_acc']:.2f}"):
        assert needle in md, needle
    assert (out / "curves.png").stat().st_size > 10_000

    # Again: finished runs are skipped without starting a process; an interrupted one resumes from its checkpoint.
    # (Its `fedlight fit` runs in this process, to save a second interpreter start.)
    started = []

    def fit_here(children, cmd, stdout, stderr, env):
        assert cmd[1:4] == ["-m", "fedlight.config.cli", "fit"]
        started.append(cmd)
        return main(cmd[3:])

    monkeypatch.setattr(runner.Children, "call", fit_here)
    (runs["fedprox"] / "summary.json").unlink()
    assert main(["reproduce", *args]) == 0
    assert len(started) == 1 and str(runs["fedprox"]) in started[0]
    printed = capsys.readouterr().out
    assert "fedavg/synthetic seed0: skipped" in printed and "fedprox/synthetic seed0: done" in printed
    assert json.loads((runs["fedprox"] / "summary.json").read_text())["final_test_acc"] == \
        summaries["fedprox"]["final_test_acc"]
    assert len(report.read_curve(runs["fedprox"])) == 2  # no round was trained twice

    # A changed spec must not reuse (or silently mix with) runs made by another command.
    write_spec(spec, mu=0.5)
    assert main(["reproduce", *args, "--cells", "fedprox/*"]) == 1
    assert "was made by another command" in capsys.readouterr().out

    # fedlight report over the table's runs: comparison table and a non-blank plot.
    assert main(["report", str(out), "--out", str(tmp_path / "rep")]) == 0
    table = (tmp_path / "rep" / "report.md").read_text()
    assert "fedavg/synthetic/seed0" in table and "fedprox/synthetic/seed0" in table
    check_png(tmp_path / "rep" / "curves.png")


def _processes_naming(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_sigterm_to_reproduce_stops_every_run_records_it_and_leaves_no_process(tmp_path, capsys):
    """SIGTERM to the `fedlight reproduce` parent reaches every `fedlight fit` it started: each stops after its round
    (or during its start-up), the parent waits for them, `--status` and job.json say "stopped", and the stop line
    says to run the same command again."""
    spec, out, ready = write_spec(tmp_path / "quick.yaml"), tmp_path / "out", tmp_path / "ready"
    args = [str(spec), "--shrink", "rounds=4,subset=256,test_subset=64,loop.local_steps=1", "--out", str(out)]
    env = {**os.environ, "FEDLIGHT_FAULT": "train@2:pause", "FEDLIGHT_FAULT_READY": str(ready)}
    proc = subprocess.Popen([sys.executable, "-m", "fedlight.config.cli", "reproduce", *args, "--jobs", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while not ready.exists():  # one run waits inside round 2
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    printed, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, printed + err
    assert err.strip().splitlines()[-1] == (
        "fedlight reproduce: stopped by SIGTERM: 2 runs stopped after a finished round, 0 not started; to continue, "
        f"run the same command again: fedlight reproduce {' '.join(args)} --jobs 2")
    assert _processes_naming(str(out)) == []
    runs = [out / cell / "synthetic" / "seed0" for cell in ("fedavg", "fedprox")]
    assert [json.loads((r / "job.json").read_text())["state"] for r in runs] == ["stopped", "stopped"]
    assert main(["reproduce", *args, "--status"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "2 runs: 2 stopped", lines


def test_dry_run_prints_resumable_commands(tmp_path, capsys):
    spec = write_spec(tmp_path / "quick.yaml")
    assert main(["reproduce", str(spec), "--seeds", "2", "--cells", "fedprox/*", "--dry-run",
                 "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("fedlight fit --config ") for ln in lines)
    assert "--seed 1" in lines[1] and "--resume auto" in lines[1] and "FedProx" in lines[1]
    assert f"{tmp_path / 'o' / 'fedprox' / 'synthetic' / 'seed1'}" in lines[1]
    assert not (tmp_path / "o").exists()


def test_fit_args_change_execution_not_identity(tmp_path, capsys):
    """--fit-args: execution-only flags reach every command; a run started without them resumes with them."""
    spec = write_spec(tmp_path / "quick.yaml")
    out = tmp_path / "o"
    assert main(["reproduce", str(spec), "--cells", "fedavg/*", "--dry-run", "--out", str(out),
                 "--fit-args", "--loop.client_parallelism vmap --devices 1"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith("--resume auto --loop.client_parallelism vmap --devices 1"), line
    s = table_spec.load_spec(spec)
    cell = table_spec.cells(s)[0]
    plain = runner.plan(s, [cell], [0], out, None)[0]
    fast = runner.plan(s, [cell], [0], out, None, runner.execution_args("--loop.client_parallelism vmap"))[0]
    plain.path.mkdir(parents=True)
    (plain.path / "reproduce.json").write_text(json.dumps(plain.record))
    assert fast.valid() and fast.record["execution"] == ["--loop.client_parallelism", "vmap"]
    other = runner.plan({**s, "base": "recipes/fedavg_mlp_fmnist_dir0.1.yaml"}, [cell], [0], out, None)[0]
    assert not other.valid()  # a different experiment in the same folder is still a conflict
    with pytest.raises(ConfigError, match=r"--fit-args.*--loop.lr changes the experiment"):
        runner.execution_args("--loop.lr 0.2")


def check_png(path: Path) -> None:
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.shape[0] >= 300 and img.shape[1] >= 600, img.shape
    rgb = img[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05  # not a blank canvas
    colored = (rgb.max(axis=1) - rgb.min(axis=1)) > 0.3  # plotted lines are coloured; axes and text are grey
    assert colored.sum() > 200


def test_report_writes_table_csv_and_plot(tmp_path, capsys):
    a = fake_run(tmp_path / "runs" / "fedsam", [0.2, 0.4, 0.5, 0.6], [2.0, 1.5, 1.2, 1.0])
    b = fake_run(tmp_path / "runs" / "fedavg", [0.1, 0.3, None, 0.45], [2.2, 1.9, 1.7, 1.6])
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "rep"), "--title", "two runs"]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| fedsam | FedSAM | 4 | 60.00 | 60.00 (4) | 1.0000 | 0.500 |" in md
    assert "| fedavg | FedSAM | 4 | 45.00 |" in md
    rows = list(csv.DictReader((tmp_path / "rep" / "report.csv").open()))
    assert [r["run"] for r in rows] == ["fedsam", "fedavg"] and float(rows[0]["final_test_acc"]) == 0.6
    check_png(tmp_path / "rep" / "curves.png")
    assert "wrote" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "rep2")]) == 2


def test_previous_table_fills_seeds_whose_runs_are_gone(tmp_path, capsys):
    """--previous: a table rebuilt after some run folders were lost (another machine, a cleaned disk) takes those
    seeds' values from the earlier table.csv, counts them in the header and keeps each seed's revision; a run
    finished here always wins over the earlier value; a wrong file is refused before anything runs."""
    spec, out = write_spec(tmp_path / "quick.yaml"), tmp_path / "out"
    accs = {("fedavg", 0): [0.30, 0.40], ("fedavg", 1): [0.35, 0.50], ("fedprox", 0): [0.20, 0.45],
            ("fedprox", 1): [0.25, 0.55]}
    for (row, seed), a in accs.items():
        fake_run(out / row / "synthetic" / f"seed{seed}", a, versions={"git_revision": f"rev-{row}{seed}"})
    base = ["reproduce", str(spec), "--seeds", "2", "--out", str(out), "--table-only"]
    assert main(base) == 0
    first = {(r["cell"], r["metric"]): r for r in csv.DictReader((out / "table.csv").open())}
    assert json.loads(first[("fedprox/synthetic", "final_test_acc")]["values"]) == pytest.approx([45.0, 55.0])
    assert json.loads(first[("fedprox/synthetic", "final_test_acc")]["revisions"]) == ["rev-fedprox0", "rev-fedprox1"]
    earlier = tmp_path / "earlier.csv"
    earlier.write_text((out / "table.csv").read_text())

    import shutil
    shutil.rmtree(out / "fedprox" / "synthetic" / "seed1")
    assert main(base) == 0
    lost = {(r["cell"], r["metric"]): r for r in csv.DictReader((out / "table.csv").open())}
    assert json.loads(lost[("fedprox/synthetic", "final_test_acc")]["values"])[1] == "missing"

    assert main([*base, "--previous", str(earlier)]) == 0
    again = {(r["cell"], r["metric"]): r for r in csv.DictReader((out / "table.csv").open())}
    for key, row in first.items():  # every number is back, the mean ± std too
        assert (again[key]["values"], again[key]["mean"], again[key]["std"], again[key]["n"]) == \
            (row["values"], row["mean"], row["std"], row["n"]), key
    assert json.loads(again[("fedprox/synthetic", "final_test_acc")]["revisions"]) == ["rev-fedprox0", "rev-fedprox1"]
    md = (out / "table.md").read_text()
    assert f"Earlier values: 1 of 4 runs' values come from `{earlier}`" in md and "rev-fedprox1" in md

    # A run finished here wins: the earlier table's (altered) value for fedavg seed 0 is not used.
    table = list(csv.DictReader(earlier.open()))
    for r in table:
        if (r["cell"], r["metric"]) == ("fedavg/synthetic", "final_test_acc"):
            r["values"] = json.dumps([99.0, *json.loads(r["values"])[1:]])
    with earlier.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    assert '"[99.0, ' in earlier.read_text()
    assert main([*base, "--previous", str(earlier)]) == 0
    rows = {(r["cell"], r["metric"]): r for r in csv.DictReader((out / "table.csv").open())}
    assert json.loads(rows[("fedavg/synthetic", "final_test_acc")]["values"])[0] == pytest.approx(40.0)

    capsys.readouterr()
    assert main([*base, "--previous", str(tmp_path / "nope.csv")]) == 2
    assert "--previous" in capsys.readouterr().err
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    assert main([*base, "--previous", str(tmp_path / "other.csv")]) == 2


def test_table_header_names_each_columns_own_metric(tmp_path):
    """Table 3: the headline is accuracy, CoLA's cells are MCC; the header says so (no runs needed)."""
    path = ROOT / "recipes" / "tables" / "fedadamw_table3.yaml"
    spec = yaml.safe_load(path.read_text())
    cs = table_spec.cells(spec)
    for c in cs:
        c.values = {m: ["missing"] for m in [c.metric, *spec["also"]]}
        c.revisions = ["missing"]
    table_report.write_table(spec, path, cs, [], [0], tmp_path, "fedlight reproduce", None, 1)
    head = next(line for line in (tmp_path / "table.md").read_text().splitlines() if line.startswith("- Metric:"))
    assert head.startswith("- Metric: final test accuracy (%) (column cola: final test MCC (Matthews correlation) "
                           "(%));"), head
    assert head.count("column ") == 1


def test_a_per_round_column_that_only_some_cells_log(tmp_path):
    """ε as a column (the DP table: `final_privacy/epsilon` in its private cells only): a cell whose runs do not log
    the key shows "—" (no value), the others their value; a key no finished run of the table logs is still
    an unknown metric, one line."""
    spec = yaml.safe_load(write_spec(tmp_path / "s.yaml").read_text()) | {"also": ["final_privacy/epsilon"]}
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    plain = fake_run(out / "fedavg" / "synthetic" / "seed0", [0.3, 0.4])
    private = fake_run(out / "fedprox" / "synthetic" / "seed0", [0.2, 0.45])
    rows = [json.loads(x) for x in (private / "metrics.jsonl").read_text().splitlines()[:2]]
    (private / "metrics.jsonl").write_text("".join(json.dumps(r | {"privacy/epsilon": e}) + "\n"
                                                   for r, e in zip(rows, (1.5, 2.25))))
    assert main(["reproduce", str(tmp_path / "dp.yaml"), "--out", str(out), "--table-only"]) == 0
    got = {(r["cell"], r["metric"]): r for r in csv.DictReader((out / "table.csv").open())}
    assert float(got["fedprox/synthetic", "final_privacy/epsilon"]["mean"]) == 2.25
    assert got["fedavg/synthetic", "final_privacy/epsilon"]["mean"] == "" and "| — |" in (out / "table.md").read_text()
    assert float(got["fedavg/synthetic", "final_test_acc"]["mean"]) == pytest.approx(40.0)
    with pytest.raises(ConfigError, match="unknown metric `final_server/momentum_variance`: no round"):
        report.metric_value(plain, "final_server/momentum_variance")  # one run alone: strict
    (tmp_path / "none.yaml").write_text(yaml.safe_dump(spec | {"also": ["final_server/momentum_variance"]}))
    assert main(["reproduce", str(tmp_path / "none.yaml"), "--out", str(out), "--table-only"]) == 2


def test_read_only_modes_write_nothing_and_refuse_an_unknown_output_in_one_line(tmp_path, capsys):
    """Issue 60: `--table-only` on a folder that holds no run wrote an empty table there (a misspelt --out)."""
    spec, out = write_spec(tmp_path / "quick.yaml"), tmp_path / "nothing"
    for mode in ("--status", "--dry-run"):
        assert main(["reproduce", str(spec), "--out", str(out), mode]) == 0
    capsys.readouterr()
    assert main(["reproduce", str(spec), "--out", str(out), "--table-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"`--table-only`: {out} does not exist, so it holds no run of this table" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quick.yaml"]
