"""``metrics.jsonl`` rows chained to their run and to the rows before them; ``--resume`` checks what ``fedlight verify``
checks before it trains a round (issue 68, items 1 and 2): another run's file swapped in, a row edited in a finished
run, alone and in a lockstep group; a run written before the chain still reads and resumes."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedlight.config.cli import main
from fedlight.run import atomic
from fedlight.run.rows import CHAIN, chain_problem, chained

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
BASE = ["--config", TINY, "--loop.eval_every", "1", "--loggers", "null"]
FLAGS = [*BASE, "--loop.rounds", "6"]
FIVE = [*BASE, "--loop.rounds", "5"]


def _main(*argv) -> int:
    return main(list(argv))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_the_chain_binds_each_row_to_its_run_and_the_rows_before_it():
    rows, prev = [], ""
    for k in (1, 2, 3):
        rows.append(chained({"round": k, "test_acc": 0.5 + k / 10}, "run-a", prev))
        prev = rows[-1][CHAIN]
    assert chain_problem(rows, "run-a") is None
    assert "round 1 is not the row this run wrote" in chain_problem(rows, "run-b")  # another run's identity
    edited = [rows[0], {**rows[1], "test_acc": 0.99}, rows[2]]
    assert "round 2 is not the row this run wrote" in chain_problem(edited, "run-a")
    assert "round 3 is not the row" in chain_problem([rows[0], rows[2]], "run-a")  # a row dropped
    old = [{k: v for k, v in r.items() if k != CHAIN} for r in rows]
    assert chain_problem(old, "run-a") is None  # written before the chain: read as before
    assert "round 3 lacks its chain digest" in chain_problem([*rows[:2], old[2]], "run-a")


@pytest.fixture(scope="module")
def killed_group(tmp_path_factory):
    """Two runs of a lockstep group (seeds 0 and 1) killed by one SIGKILL in round 4 (checkpoint of round 3)."""
    g = tmp_path_factory.mktemp("killed") / "g"
    cmd = [sys.executable, "-m", "fedlight.config.cli", "lockstep", *FLAGS, "--out_dir", str(g), "--seeds", "0,1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FEDLIGHT_FAULT": "train@4"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    assert [r["round"] for r in _rows(g / "seed0")] == [1, 2, 3]
    return g


def test_a_resume_refuses_another_runs_metrics_alone_and_in_a_group(killed_group, tmp_path, capsys):
    g = tmp_path / "g"
    shutil.copytree(killed_group, g)
    a, b = g / "seed0" / "metrics.jsonl", g / "seed1" / "metrics.jsonl"
    mine, theirs = a.read_bytes(), b.read_bytes()
    a.write_bytes(theirs)
    b.write_bytes(mine)
    assert _main("verify", str(g / "seed0")) == 2
    capsys.readouterr()
    assert _main("fit", *FLAGS, "--seed", "0", "--out_dir", str(g / "seed0"), "--resume", "auto") == 2
    line = _error(capsys)
    assert line.startswith(f"fedlight fit: error: {a} is damaged: its row of round 3 is not the one the checkpoint of "
                           "that round carries"), line
    assert "start over with `--overwrite true`" in line
    assert _main("lockstep", *FLAGS, "--out_dir", str(g), "--seeds", "0,1", "--resume", "auto") == 2
    err = capsys.readouterr().err
    for k, path in ((0, a), (1, b)):
        assert f"fedlight lockstep: {g / f'seed{k}'}: failed: DamagedFile: {path} is damaged: its row of round 3" in err
    assert a.read_bytes() == theirs and b.read_bytes() == mine  # nothing adopted, nothing rewritten
    assert not (g / "seed0" / "summary.json").exists()
    a.write_bytes(mine)  # put back: the run continues, and ends as verify wants it
    assert _main("fit", *FLAGS, "--seed", "0", "--out_dir", str(g / "seed0"), "--resume", "auto") == 0
    assert [r["round"] for r in _rows(g / "seed0")] == [1, 2, 3, 4, 5, 6]
    assert _main("verify", str(g / "seed0")) == 0


@pytest.fixture(scope="module")
def finished_group(tmp_path_factory):
    g = tmp_path_factory.mktemp("finished") / "g"
    assert _main("lockstep", *FIVE, "--out_dir", str(g), "--seeds", "0,1") == 0
    return g


def _edit_row_4(out: Path) -> None:
    rows = _rows(out)
    rows[3]["test_acc"] = round(rows[3]["test_acc"] + 0.01, 6)  # still a plausible accuracy
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("group", [False, True])
def test_an_edited_row_of_a_finished_run_is_found_by_verify_and_refused_by_resume(group, finished_group, tmp_path,
                                                                                  capsys):
    g = tmp_path / "g"
    shutil.copytree(finished_group, g)
    out = g / "seed0"
    assert _main("verify", str(out)) == 0
    _edit_row_4(out)
    capsys.readouterr()
    assert _main("verify", str(out)) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert ("damaged  metrics.jsonl: its row of round 4 is not the row this run wrote there (its chain digest does "
            "not match: edited after it was written, or another run's)") in lines, lines
    if group:
        assert _main("lockstep", *FIVE, "--out_dir", str(g), "--seeds", "0,1",
                     "--resume", "auto") == 2
        err = capsys.readouterr().err
        assert f"{out}: failed: DamagedFile: {out / 'metrics.jsonl'} is damaged: its row of round 4" in err, err
        assert f"{g / 'seed1'}: failed" not in err  # the other member finished again, untouched
    else:
        assert _main("fit", *FIVE, "--seed", "0", "--out_dir", str(out),
                     "--resume", "auto") == 2
        assert _error(capsys).startswith(f"fedlight fit: error: {out / 'metrics.jsonl'} is damaged: its row of round 4")
    assert _main("verify", str(out)) == 2  # still found: never adopted


def test_a_finished_runs_resume_rebuilds_its_summary_and_refuses_a_damaged_previous_checkpoint(finished_group,
                                                                                               tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_group / "seed0", out)
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "final_test_acc": 0.99}))
    argv = ["fit", *FIVE, "--out_dir", str(out), "--resume", "auto"]
    capsys.readouterr()
    assert _main("verify", str(out)) == 2
    assert _main(*argv) == 0
    assert f"fedlight: note: {out / 'summary.json'} is damaged: its content differs" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["final_test_acc"] == summary["final_test_acc"]
    assert _main("verify", str(out)) == 0
    prev = out / "checkpoints" / "prev.ckpt"
    data = bytearray(prev.read_bytes())
    data[len(data) // 2] ^= 1
    prev.write_bytes(bytes(data))
    capsys.readouterr()
    assert _main(*argv) == 2  # a finished run's resume writes no checkpoint: it cannot repair prev.ckpt
    assert _error(capsys).startswith(f"fedlight fit: error: {prev} is damaged: ")


def test_a_run_written_before_the_chain_still_verifies_and_resumes(finished_group, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_group / "seed1", out)
    rows = [{k: v for k, v in r.items() if k != CHAIN} for r in _rows(out)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("last.ckpt", "prev.ckpt"):  # as an older fedlight wrote them: the row without its digest
        path = out / "checkpoints" / name
        ckpt = torch.load(path, weights_only=True)
        ckpt["last_row"] = json.dumps({k: v for k, v in json.loads(ckpt["last_row"]).items() if k != CHAIN})
        atomic.atomic_torch_save(ckpt, path)
    capsys.readouterr()
    assert _main("verify", str(out)) == 0
    assert ("ok       metrics.jsonl (5 rounds; written before rows were chained to their run: an edited row is not "
            "found)") in capsys.readouterr().out
    assert _main("fit", *FLAGS, "--seed", "1", "--out_dir", str(out),
                 "--resume", "auto") == 0
    after = _rows(out)
    assert [CHAIN in r for r in after] == [False] * 5 + [True]  # the new row chained, the old ones read as before
    assert _main("verify", str(out)) == 0
