"""``fedlight reproduce --lockstep``: the runs that can share a stacked chunk (the seeds of a row; rows with the same
local rule) run as lockstep groups, and each run directory is an ordinary run (verify, resume alone)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from fedlight.config.cli import main
from fedlight.errors import ConfigError
from fedlight.lab.tables import lockstep_runs, runner

SHRINK = "rounds=2,test_subset=128,loop.local_steps=2"
VMAP = "--loop.client_parallelism vmap"


def write_spec(path: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "title": "Three rows, two local rules",
        "base": "recipes/quickstart.yaml",
        "metric": "final_test_acc",
        "rows": {"fedavg": {"algorithm": {"class_path": "fedlight.algorithms.FedAvg"}},
                 "fedavgm": {"algorithm": {"class_path": "fedlight.algorithms.FedAvgM"}},
                 "fedprox": {"algorithm": {"class_path": "fedlight.algorithms.FedProx", "init_args": {"mu": 0.01}}}},
        "columns": {"synthetic": {}},
    }, sort_keys=False))
    return path


def test_modes():
    assert lockstep_runs.parse_mode("auto") == "auto" and lockstep_runs.parse_mode("3") == 3
    with pytest.raises(ConfigError, match="--lockstep"):
        lockstep_runs.parse_mode("0")
    assert lockstep_runs.decide("off", "local")[0] == 1 and lockstep_runs.decide("on", "local")[0] is None
    assert lockstep_runs.decide("auto", "local")[0] == (None if torch.cuda.is_available() else 1)
    assert lockstep_runs.decide(2, "local")[0] == 2 and lockstep_runs.decide("column", "local")[0] is None
    assert lockstep_runs.decide("auto", "slurm")[0] == 1
    with pytest.raises(ConfigError, match="slurm"):
        lockstep_runs.decide("on", "slurm")


def test_reproduce_groups_seeds_and_rows_of_one_local_rule(tmp_path, capsys, monkeypatch):
    spec, out = write_spec(tmp_path / "t.yaml"), tmp_path / "out"
    args = [str(spec), "--seeds", "2", "--shrink", SHRINK, "--out", str(out), "--fit-args", VMAP, "--lockstep", "on"]
    assert main(["reproduce", *args, "--dry-run"]) == 0
    commands = capsys.readouterr().out.splitlines()
    assert len(commands) == 2 and all(c.startswith("fedlight lockstep ") for c in commands)
    assert commands[0].count(" :: ") == 3 and "FedAvgM" in commands[0] and "FedProx" not in commands[0]
    assert commands[1].count(" :: ") == 1 and "FedProx" in commands[1]  # its local rule differs: a group of its own

    started = []

    def here(children, cmd, stdout, stderr, env):  # in this process, to save interpreter starts
        started.append(cmd[3])
        return main(cmd[3:])

    monkeypatch.setattr(runner.Children, "call", here)
    assert main(["reproduce", *args]) == 0
    printed = capsys.readouterr()
    assert started == ["lockstep", "lockstep"], started
    lines = (printed.out + printed.err).splitlines()
    assert "6 runs in 2 processes" in printed.out
    assert len([x for x in lines if re.match(r"\[\d/6\] .* seed\d: done", x)]) == 6
    assert any("4 of 4 run-rounds trained" in x for x in lines) and any("8 of 8 run-rounds" in x for x in lines)
    runs = sorted(out.glob("*/synthetic/seed*"))
    assert len(runs) == 6
    for run in runs:
        assert main(["verify", str(run)]) == 0
        assert json.loads((run / "job.json").read_text())["state"] == "done"

    # A run of the group resumes alone: its summary gone, `fedlight fit --resume auto` (the command reproduce would
    # give it alone) finishes it without training a round again, to the same model.
    run = out / "fedavgm" / "synthetic" / "seed1"
    before = torch.load(run / "final_model.pt", weights_only=True)
    (run / "summary.json").unlink()
    assert main(["reproduce", *args, "--lockstep", "off", "--cells", "fedavgm/*"]) == 0
    assert started[2:] == ["fit"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    after = torch.load(run / "final_model.pt", weights_only=True)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_column_mode_puts_every_rule_of_a_column_in_one_process(tmp_path, capsys):
    """``--lockstep column``: the 6 runs (three rules, two local rules) in one ``fedlight lockstep`` process, which
    trains FedAvg with FedAvgM as one union and FedProx as another; each run ends as the same run in ``on`` mode."""
    spec = write_spec(tmp_path / "t.yaml")
    base = [str(spec), "--seeds", "2", "--shrink", SHRINK, "--fit-args", VMAP]
    assert main(["reproduce", *base, "--out", str(tmp_path / "c"), "--lockstep", "column", "--dry-run"]) == 0
    commands = capsys.readouterr().out.splitlines()
    assert len(commands) == 1 and commands[0].count(" :: ") == 5 and "FedProx" in commands[0]
    for mode in ("column", "on"):
        assert main(["reproduce", *base, "--out", str(tmp_path / mode), "--lockstep", mode, "--jobs", "1"]) == 0
    assert "6 runs in 1 processes" in capsys.readouterr().out
    for run in sorted((tmp_path / "on").glob("*/synthetic/seed*")):
        other = tmp_path / "column" / run.relative_to(tmp_path / "on")
        a, b = (torch.load(r / "final_model.pt", weights_only=True) for r in (run, other))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), run
