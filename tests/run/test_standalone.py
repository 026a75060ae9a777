"""A run directory that stands alone (issue 41): copied or moved, it resumes bit for bit on its own files; every file
a checkpoint names is checked before round 1; config.yaml and summary.json prove their content; `--overwrite` removes
only fedlight's files; bad input is one line, exit 2."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from fedlight.config.cli import main
from fedlight.run import directory, faults, side_files

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")


def _fit(out, rounds, *extra):
    return main(["fit", "--config", TINY, "--out_dir", str(out), "--loop.rounds", str(rounds), *extra])


def _final(out):
    return torch.load(Path(out) / "final_model.pt", weights_only=True)


def _same(out, reference):
    final = _final(out)
    return final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def _named(out, name):
    """{client id: path relative to the run directory} of the client-state files ``checkpoints/<name>`` names."""
    ckpt = torch.load(Path(out) / "checkpoints" / name, weights_only=True)
    return {int(c): e["path"] for c, e in ckpt["store"]["spilled"].items()}


def _flip(path):
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x10
    Path(path).write_bytes(bytes(data))


@pytest.fixture(autouse=True)
def _fresh_fault_counts(monkeypatch):
    monkeypatch.setattr(faults, "_writes", {})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert _fit(out, 4) == 0
    return _final(out)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert _fit(out, 2) == 0
    return out


# ------------------------------------------------------------------------------------------------ copy and move
def test_a_copied_then_moved_run_resumes_bitwise_on_its_own_files_and_leaves_the_original_alone(reference, tmp_path,
                                                                                                capsys):
    original, copy, moved = tmp_path / "o", tmp_path / "c", tmp_path / "m"
    assert _fit(original, 2) == 0
    before = _tree(original)
    shutil.copytree(original, copy)
    assert _fit(copy, 3, "--resume", "auto") == 0
    assert _tree(original) == before  # nothing written or deleted outside the copy
    assert main(["verify", str(copy)]) == 0
    assert all(not Path(p).is_absolute() for p in _named(copy, "last.ckpt").values())
    assert all((copy / p).is_file() for p in _named(copy, "last.ckpt").values())
    shutil.rmtree(original)
    copy.rename(moved)
    capsys.readouterr()
    assert main(["verify", str(moved)]) == 0  # a moved run verifies: no file points outside it
    assert _fit(moved, 4, "--resume", "auto") == 0
    assert _same(moved, reference)
    assert main(["verify", str(moved)]) == 0


# --------------------------------------------------------------------------------------------- checked before round 1
def test_a_damaged_client_state_at_resume_continues_from_the_previous_checkpoint_bitwise(reference, tmp_path, capsys):
    out = tmp_path / "run"
    assert _fit(out, 2) == 0
    last, prev = _named(out, "last.ckpt"), _named(out, "prev.ckpt")
    cid, path = next((c, p) for c, p in sorted(last.items()) if p not in prev.values())
    _flip(out / path)
    capsys.readouterr()
    assert _fit(out, 4, "--resume", "auto") == 0
    err = capsys.readouterr().err
    assert (f"fedlight: note: checkpoint {out}/checkpoints/last.ckpt names client {cid}'s state file "
            f"{out / path}, which is damaged: its bytes differ from the ones written (CRC-32 mismatch); continuing "
            f"from the previous good checkpoint {out}/checkpoints/prev.ckpt (round 1)") in err, err
    assert _same(out, reference)
    assert main(["verify", str(out)]) == 0


def test_a_client_state_both_checkpoints_name_damaged_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert _fit(out, 2) == 0
    last, prev = _named(out, "last.ckpt"), _named(out, "prev.ckpt")
    cid, path = next((c, p) for c, p in sorted(last.items()) if p in prev.values())
    _flip(out / path)
    capsys.readouterr()
    assert _fit(out, 4, "--resume", "auto") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"fedlight fit: error: checkpoint {out}/checkpoints/last.ckpt names client {cid}'s "
                              f"state file {out / path}, which is damaged"), err
    assert "the previous one is unusable too" in err[-1] and "Traceback" not in "".join(err)


def test_a_client_state_damaged_after_the_checks_ends_the_run_in_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert _fit(out, 2) == 0
    for path in {*_named(out, "last.ckpt").values(), *_named(out, "prev.ckpt").values()}:
        _flip(out / path)
    from fedlight.run.atomic import load_checkpoint

    monkeypatch.setattr(directory, "_load_whole", load_checkpoint)  # damaged between the check and the read
    capsys.readouterr()
    assert _fit(out, 4, "--resume", "auto") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "is damaged: its bytes differ from the ones written (CRC-32 mismatch); continue with `--resume auto`" in \
        err[-1] and err[-1].startswith("fedlight fit: error: client "), err


# ------------------------------------------------------------------------------------------------ verify
def _edit_lr(out):
    text = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(text.replace("lr: 0.05", "lr: 0.5", 1))


def _both_checkpoints_and_three_states(out):
    for name in ("last.ckpt", "prev.ckpt"):
        _flip(out / "checkpoints" / name)
    states = sorted((out / "client_state" / "rank0").glob("*.bin"))[:3]
    for p in states:
        _flip(p)
    return ["checkpoints/last.ckpt", "checkpoints/prev.ckpt", *(str(p.relative_to(out)) for p in states)]


@pytest.mark.parametrize(("damage", "expected"), [
    (_edit_lr, ["config.yaml: its content differs from the one written (SHA-256 mismatch)"]),
    (lambda out: (out / "config.yaml").write_text("ÿ"), ["config.yaml: it carries no digest"]),  # valid YAML
    (lambda out: (out / "config.yaml").write_bytes(b"\xff"), ["config.yaml: not UTF-8"]),
    (lambda out: (out / "summary.json").write_text('{"final_test_acc": 0.99}\n'),
     ["summary.json: it carries no digest (edited, or not written by fedlight)"]),
    (lambda out: (out / "summary.json").write_text(side_files.seal_summary(
        {**json.loads((out / "summary.json").read_text()), "rounds_completed": 5})),
     ["summary.json: it reports 5 rounds and metrics.jsonl 2: not this run's summary"]),
    (lambda out: _flip(out / _named(out, "last.ckpt")[min(_named(out, "last.ckpt"))]),
     ["client_state/rank0/c"]),
    (_both_checkpoints_and_three_states, None),
], ids=["config-edited", "config-garbage", "config-binary", "summary-replaced", "summary-other-run", "client-state",
        "both-checkpoints"])
def test_verify_names_each_damage(damage, expected, finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    capsys.readouterr()
    named = damage(out)
    assert main(["verify", str(out)]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    bad = [ln.removeprefix("damaged  ") for ln in lines if ln.startswith("damaged")]
    if expected is None:  # every damaged file named, the client states by the CRC-32 in their names
        assert sorted(b.split(":")[0] for b in bad) == sorted(named) and lines[-1] == f"{out}: 5 damaged files"
    else:
        assert len(bad) == 1 and bad[0].startswith(expected[0]), lines


@pytest.mark.parametrize("damage", [_edit_lr, lambda out: (out / "config.yaml").write_text("ÿ")],
                         ids=["edited", "garbage"])
def test_a_damaged_config_is_rewritten_at_resume_with_a_note(damage, finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    good = (out / "config.yaml").read_text()
    damage(out)
    capsys.readouterr()
    assert _fit(out, 3, "--resume", "auto") == 0
    assert f"fedlight: note: {out}/config.yaml is damaged: " in capsys.readouterr().err
    import yaml

    now, then = yaml.safe_load((out / "config.yaml").read_text()), yaml.safe_load(good)
    for cfg in (now, then):  # the execution-only settings of this segment
        cfg.pop("out_dir"), cfg.pop("resume", None), cfg["loop"].pop("rounds")
    assert now == then and now["loop"]["lr"] == 0.05
    assert main(["verify", str(out)]) == 0


def test_the_unsealed_config_of_a_run_from_before_the_digests_is_sealed_at_resume_with_a_note(finished, tmp_path,
                                                                                               capsys):
    """A run written before fedlight sealed its side files (its checkpoint names client states by absolute path):
    its config.yaml, without a digest line, is rewritten with one at resume, and the run says so; the same file in a
    run whose checkpoint is of the sealing kind is an edit, said as damage."""
    from fedlight.config import resume
    from fedlight.run import side_files

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    text = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(text.rpartition(side_files.TAG)[0])  # as an older fedlight wrote it
    capsys.readouterr()
    assert resume.config_damaged(out, {"store": {"paths": "absolute"}})
    assert (f"fedlight: note: {out}/config.yaml was written by a fedlight that did not seal it (no digest line): "
            "rewritten from the checkpoint's settings") in capsys.readouterr().err
    assert resume.config_damaged(out, {"store": {"paths": "relative"}})
    assert f"{out}/config.yaml is damaged: {side_files.UNSEALED}" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ overwrite
def test_overwrite_refuses_a_folder_that_is_not_a_run_and_leaves_foreign_files_of_a_run(finished, tmp_path, capsys):
    stray = tmp_path / "stray"
    for name, text in {"tb/notes.txt": "mine", "checkpoints/my.pt": "mine"}.items():
        (stray / name).parent.mkdir(parents=True, exist_ok=True)
        (stray / name).write_text(text)
    before = _tree(stray)
    assert _fit(stray, 1, "--overwrite", "true") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fedlight fit: error: `overwrite` refuses to clear {stray}: it holds "
                                               "no config.yaml and no checkpoint of a fedlight run"), err
    assert _tree(stray) == before
    (stray / "metrics.jsonl").write_text('{"round": 1}\n')  # a per-round log beside no fedlight run: not fedlight's
    before = _tree(stray)
    assert _fit(stray, 1, "--overwrite", "true") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not write: metrics.jsonl (its content is not what fedlight writes)" in err[0], err
    assert _tree(stray) == before
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "tb" / "mine.txt").write_text("mine")
    (run / "checkpoints" / "keep.pt").write_text("mine")
    trackers = ("csv/version_0/metrics.csv", "csv/version_0/hparams.yaml", "wandb/run-1-x/files/config.yaml",
                "wandb/run-1-x/run-x.wandb", "trackers.json")  # the CSV and W&B trackers' files, as they lay them out
    for name in (*trackers, "csv/notes.txt"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("written")
    (run / "trackers.json").write_text('{"wandb": {"id": "x", "logged": 2}}\n')  # as fedlight writes it
    (run / "wandb" / "latest-run").symlink_to(run / "wandb" / "run-1-x")
    assert _fit(run, 1, "--overwrite", "true") == 0
    assert (run / "tb" / "mine.txt").read_text() == "mine" and (run / "checkpoints" / "keep.pt").read_text() == "mine"
    assert (f"fedlight: note: `--overwrite` removed fedlight's files from {run} and left 3 it did not write: "
            "checkpoints/keep.pt, tb/mine.txt, csv/notes.txt") in capsys.readouterr().err
    assert not (run / "wandb").exists() and not (run / "csv" / "version_0").exists()
    assert not (run / "trackers.json").exists() and (run / "csv" / "notes.txt").read_text() == "written"
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 1


# ------------------------------------------------------------------------------------------------ one line, exit 2
def _binary(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(bytes(range(128, 256)) * 4)
    return ["fit", "--config", str(tmp_path / "bin.yaml"), "--out_dir", str(tmp_path / "o")]


@pytest.mark.parametrize(("argv", "message"), [
    (_binary, "fedlight fit: error: `--config` {tmp}/bin.yaml is not a text recipe (byte 0 is not UTF-8)"),
    (lambda tmp: ["fit", "--config", TINY, "--out_dir", "/proc/self/fd"],
     "fedlight fit: error: `out_dir` /proc/self/fd cannot be used: it is on /proc (proc), a kernel file system"),
    (lambda tmp: ["fit", "--config", TINY, "--out_dir", str(tmp / "o"), "--loop.lr", "nan"],
     "fedlight fit: error: `loop.lr` must be a finite number, got nan"),
    (lambda tmp: ["reproduce", str(Path(__file__).parents[2] / "recipes" / "tables" / "fedadamw_table1.yaml"),
                  "--shrink", "eval_every=2", "--dry-run", "--out", str(tmp / "t")],
     "fedlight reproduce: error: `--shrink`: 'eval_every' is not a setting of `fedlight fit`; did you mean "
     "'loop.eval_every'?"),
], ids=["binary-config", "proc-out-dir", "lr-nan", "shrink-key"])
def test_bad_input_is_one_line_exit_2(argv, message, tmp_path, capsys):
    assert main(argv(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message.format(tmp=tmp_path)), err
    assert not (tmp_path / "o").exists() and not (tmp_path / "t").exists()


def test_tables_do_not_take_a_replaced_summary(finished, tmp_path):
    from fedlight.lab.tables import report

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    assert report.finished(out) and report.read_summary(out)["rounds_completed"] == 2
    (out / "summary.json").write_text('{"final_test_acc": 0.99, "rounds_completed": 2}\n')
    assert report.read_summary(out) is None and not report.finished(out)  # `reproduce` finishes it again
