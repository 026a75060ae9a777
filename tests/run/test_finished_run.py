"""A command that finds its run already finished says so in one line and trains nothing; ``summary.json`` names only
a client runner that trained a round. Runs are tests/configs/tiny.yaml (2 rounds), in this process."""

import json
from pathlib import Path

from fedlight.config.cli import main

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
SEQUENTIAL = "sequential (auto: cpu device (stacked clients pay off on CUDA; force with vmap))"


def _fit(out, *extra):
    return main(["fit", "--config", TINY, "--out_dir", str(out), "--resume", "auto", *extra])


def _files(out: Path) -> dict[str, tuple[int, int]]:
    """Every file of the run directory with its size and modification time (nothing rewritten keeps both)."""
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}


def _summary(out) -> dict:
    return json.loads((Path(out) / "summary.json").read_text())


def test_a_finished_run_found_again_is_one_line_and_nothing_trained(tmp_path, capsys):
    out = tmp_path / "run"
    assert _fit(out) == 0
    capsys.readouterr()
    before, summary = _files(out), _summary(out)
    assert summary["client_runner"] == SEQUENTIAL

    assert _fit(out, "--loop.client_parallelism", "vmap") == 0  # execution-only: the same run, the same folder
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.splitlines() == [
        f"fedlight: {out} already holds this run, finished (2 rounds, final test acc "
        f"{summary['final_test_acc'] * 100:.2f}%); loop.client_parallelism changed, execution-only (the same run, in "
        "the same folder): nothing trained. To train it anew pass `--overwrite true` or another `--out_dir`"]
    assert _files(out) == before  # nothing written: no round, no summary naming the vmap runner

    assert _fit(out) == 0  # as it was trained: the same line without a changed setting
    assert "; loop.client_parallelism" not in capsys.readouterr().err
    assert _files(out) == before

    # told to overwrite, it starts over (the recipe's `resume: auto` notwithstanding), with the runner asked for
    assert _fit(out, "--loop.client_parallelism", "vmap", "--overwrite", "true") == 0
    again = _summary(out)
    assert again["run_id"] != summary["run_id"]
    assert again["client_runner"] == "stacked, eager (loop.client_parallelism: vmap)"
    assert [s["from_round"] for s in again["segments"]] == [0]
    assert again["final_test_acc"] == summary["final_test_acc"]  # the stacked runner computes the same run


def test_a_finishing_pass_that_trains_no_round_keeps_the_runner_that_trained(tmp_path, capsys):
    """Stopped between its last checkpoint and its summary (or given a tracker to send its rounds to), a run is
    finished by a command that trains no round: summary.json names the runner of the rounds, not this command's."""
    out = tmp_path / "run"
    assert _fit(out) == 0
    first = _summary(out)
    (out / "summary.json").unlink()
    (out / "final_model.pt").unlink()
    capsys.readouterr()
    assert _fit(out, "--loop.client_parallelism", "vmap") == 0
    err = capsys.readouterr().err
    assert "client runner:" not in err and "already holds" not in err, err
    summary = _summary(out)
    assert summary["client_runner"] == SEQUENTIAL and summary["client_runner_fallbacks"] == []
    assert [s["from_round"] for s in summary["segments"]] == [0, 2]
    assert summary["segments"][0]["client_runner"] == SEQUENTIAL and "client_runner" not in summary["segments"][1]
    assert summary["final_test_acc"] == first["final_test_acc"] and (out / "final_model.pt").is_file()

    # a tracker added to the finished run: its rounds are sent (CSV), nothing trained, the runner still the one
    assert _fit(out, "--loop.client_parallelism", "vmap", "--loggers", "[tensorboard, csv]") == 0
    assert json.loads((out / "trackers.json").read_text())["csv"]["logged"] == 2
    assert _summary(out)["client_runner"] == SEQUENTIAL
    capsys.readouterr()
    assert _fit(out, "--loggers", "[tensorboard, csv]") == 0  # now it holds them: finished, one line
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_a_runs_files_are_as_readable_as_the_umask_allows(tmp_path):
    """Atomic writes go through ``mkstemp`` (0600); the run's files get the mode the process's umask gives a new
    file, so colleagues on a shared machine read them as they read anything else the user writes."""
    import os

    umask = os.umask(0o022)
    os.umask(umask)
    out = tmp_path / "run"
    assert _fit(out) == 0
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert {"summary.json", "config.yaml", "final_model.pt", "checkpoints/last.ckpt"} <= modes.keys()
    assert {name: mode for name, mode in modes.items() if mode != 0o666 & ~umask} == {}
