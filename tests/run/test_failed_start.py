"""A run directory in which no round finished is not a run; ``--resume auto`` that finds nothing says so."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from fedlight.config.cli import main

ROOT = Path(__file__).resolve().parent.parent.parent
TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _cli(*args, cwd=None, env=None):
    """A real ``fedlight fit`` process (one that a fault kills)."""
    cmd = [sys.executable, "-m", "fedlight", "fit", "--config", TINY, "--loop.rounds", "1", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**ENV, **(env or {})}, cwd=cwd)


def _fit(*args):
    """``fedlight fit`` in this process (saves an interpreter start): its exit status and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["fit", "--config", TINY, "--loop.rounds", "1", *map(str, args)])
    return SimpleNamespace(returncode=code, stderr=err.getvalue())


def test_rerun_after_a_failed_start_reuses_the_directory(tmp_path):
    out = tmp_path / "run"
    dead = _cli("--out_dir", out, env={"FEDLIGHT_FAULT": "train@1"})  # killed inside round 1
    assert dead.returncode == -signal.SIGKILL and (out / "config.yaml").exists()
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
    res = _fit("--out_dir", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{out} holds a run that finished no round; reusing it" in res.stderr
    assert [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    again = _fit("--out_dir", out)  # now a round finished: a run, refused as before
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_a_directory_with_foreign_files_is_still_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("seed: 0\n")
    (out / "notes.txt").write_text("mine")
    res = _fit("--out_dir", out)
    assert res.returncode == 2 and "that fedlight did not write: config.yaml" in res.stderr  # not a recipe
    assert (out / "notes.txt").read_text() == "mine"


def test_resume_auto_that_finds_nothing_says_so_and_names_the_differing_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = _fit()
    assert first.returncode == 0, first.stderr[-3000:]
    res = _fit("--loop.lr", "0.5", "--resume", "auto")
    assert res.returncode == 0, res.stderr[-3000:]
    note = next(x for x in res.stderr.splitlines() if "`--resume auto` found no checkpoint" in x)
    old = next(d for d in (tmp_path / "runs").iterdir() if "run directory " + str(Path("runs") / d.name)
               in first.stderr)
    assert f"{Path('runs') / old.name} is a run of the same recipe whose settings differ" in note
    assert "loop.lr is 0.05 there and 0.5 here" in note
