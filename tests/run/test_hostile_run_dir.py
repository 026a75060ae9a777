"""Run-directory integrity against a careless or hostile user (issue 13 items 1-4, 6, 7).

A refused run leaves its directory byte-identical (tree hash); one directory is held by one run at a time.
"""

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedlight.config.cli import main
from fedlight.run.directory import RunLock

ROOT = Path(__file__).resolve().parent.parent.parent
TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _cli(*args, cwd=None):
    """A real ``fedlight fit`` process (where another process must hold the directory's lock)."""
    cmd = [sys.executable, "-m", "fedlight", "fit", "--config", TINY, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=cwd)


def _fit(*args, cwd=None):
    """``fedlight fit`` in this process (saves an interpreter start): its exit status and what it wrote to stderr."""
    err = io.StringIO()
    before = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stderr(err):
            code = main(["fit", "--config", TINY, *map(str, args)])
    finally:
        os.chdir(before)
    return SimpleNamespace(returncode=code, stderr=err.getvalue())


def tree_hash(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) → sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(res, *needles):
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    for n in needles:
        assert n in res.stderr, res.stderr[-3000:]


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A finished 2-round run of tiny.yaml."""
    out = tmp_path_factory.mktemp("done") / "run"
    res = _fit("--out_dir", out, "--loop.rounds", 2)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.parametrize("args,needles", [
    (["--loop.lr", "0.5"], ["loop.lr is 0.05 there and 0.5 here"]),
    (["--loop.local_steps", "3", "--data.init_args.batch_size", "5"],
     ["loop.local_steps is 5 there and 3 here", "data.init_args.batch_size is 10 there and 5 here"]),
    (["--algorithm", "fedavg"], ["algorithm is 'scaffold' there and 'fedavg' here"]),
    (["--data.init_args.alpha", "0.5", "--precision", "64-true"],
     ["data.init_args.alpha is 1.0 there and 0.5 here", "precision is '32-true' there and '64-true' here"]),
])
def test_resume_refuses_changed_settings_and_writes_nothing(done_run, args, needles):
    before = tree_hash(done_run)
    res = _fit("--out_dir", done_run, "--loop.rounds", 2, "--resume", "auto", *args)
    _refused(res, "does not match this run", *needles)
    assert tree_hash(done_run) == before


def test_truncated_checkpoint_refused_without_a_write(tmp_path, done_run):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(done_run, out)
    ckpt = out / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    (out / "checkpoints" / "prev.ckpt").unlink()  # with it, `--resume auto` continues from it (test_integrity.py)
    before = tree_hash(out)
    _refused(_fit("--out_dir", out, "--resume", "auto"), f"checkpoint {ckpt} is damaged: it is truncated")
    assert tree_hash(out) == before


def test_execution_only_changes_resume_and_are_recorded_per_segment(tmp_path, done_run):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(done_run, out)
    res = _fit("--out_dir", out, "--resume", "auto", "--loop.rounds", 3, "--loop.save_every", 2,
               "--loop.client_parallelism", "vmap", "--loop.progress", "true")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from round 2" in res.stderr
    segments = json.loads((out / "summary.json").read_text())["segments"]
    assert [s["from_round"] for s in segments] == [0, 2]
    assert set(segments[1]["changed"]) == {"loop.rounds", "loop.save_every", "loop.client_parallelism",
                                           "loop.progress", "out_dir"}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]


def test_held_directory_refuses_a_second_run_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    lock = RunLock(out)
    lock.acquire()
    before = tree_hash(out)
    try:
        res = _cli("--out_dir", out)
        _refused(res, "is in use by another run", f"pid {os.getpid()}")
        assert tree_hash(out) == before
    finally:
        lock.release()
    assert not (out / ".fedlight.lock").exists()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".fedlight.lock").write_text(json.dumps({"pid": 999999, "host": "gone", "since": "then"}))
    res = _fit("--out_dir", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (out / ".fedlight.lock").exists()


def test_two_concurrent_runs_on_one_directory_exactly_one_proceeds(tmp_path):
    out = tmp_path / "run"
    cmds = [[sys.executable, "-m", "fedlight", "fit", "--config", TINY, "--out_dir", str(out), "--seed", str(s),
             "--loop.rounds", "6", "--resume", "auto"] for s in (1, 2)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for c in cmds]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, err in results if rc == 2)
    refusals = ("in use by another run", "seed is", "changed while")  # held; after it; it ran between check and lock
    assert "Traceback" not in loser and any(m in loser for m in refusals), loser
    rows = [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("resume", ["auto", None])
def test_a_run_that_decided_before_another_finished_there_is_refused_and_changes_nothing(tmp_path, monkeypatch, resume):
    """The race CI met: run B reads ``out`` (no checkpoint: start fresh), run A then takes the lock, trains and lets
    go, and only then B takes the lock. B must not start over A's run on a decision made on what is gone."""
    from fedlight.config import resume as resumes

    out = tmp_path / "run"
    real, theirs = resumes.start, []

    def start_then_another_run_finishes(*a, **kw):
        decided = real(*a, **kw)
        other = _cli("--out_dir", out, "--seed", 1, "--loop.rounds", 3)  # a separate process: takes and drops the lock
        assert other.returncode == 0, other.stderr[-3000:]
        theirs.append(tree_hash(out))
        return decided

    monkeypatch.setattr(resumes, "start", start_then_another_run_finishes)
    res = _fit("--out_dir", out, "--seed", 2, "--loop.rounds", 3, *(["--resume", resume] if resume else []))
    monkeypatch.setattr(resumes, "start", real)
    _refused(res, "changed while this run was starting", f"`out_dir` {out}", "run the command again")
    before = tree_hash(out)
    assert before == theirs[0] and not (out / ".fedlight.lock").exists()  # A's run, byte for byte
    assert [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    again = _fit("--out_dir", out, "--seed", 2, "--loop.rounds", 3, "--resume", "auto")  # decides afresh: A's run
    _refused(again, "seed is")
    assert tree_hash(out) == before


def test_default_directories_differ_when_settings_differ(tmp_path):
    runs = []
    for extra in ([], ["--algorithm", "fedavg"], ["--loop.progress", "true"]):
        res = _fit("--loop.rounds", 1, "--resume", "auto", *extra, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        lines = res.stderr.splitlines()
        named = [x.split("run directory ", 1)[1] for x in lines if x.startswith("fedlight: run directory ")]
        named += [x.removeprefix("fedlight: ").split(" already holds this run, finished ", 1)[0] for x in lines
                  if " already holds this run, finished " in x]  # the run found finished: nothing trained
        runs.append(named[0].strip())
    assert runs[0] != runs[1]  # another algorithm: another directory
    assert runs[0] == runs[2]  # an execution-only setting: the same run (found finished)
    assert all((tmp_path / r / "summary.json").is_file() for r in runs)


@pytest.mark.parametrize("where,needle", [
    ("file", "is not a directory"),
    ("under_file", "is a file"),
    ("proc", "cannot be"),
])
def test_unusable_out_dir_is_one_message(tmp_path, where, needle):
    (tmp_path / "f").write_text("x")
    out = {"file": tmp_path / "f", "under_file": tmp_path / "f" / "run", "proc": Path("/proc/fedlight-test/run")}[where]
    _refused(_fit("--out_dir", out, "--loop.rounds", 1), needle, "`out_dir`")
    assert (tmp_path / "f").read_text() == "x"


def test_absurd_learning_rate_is_refused_before_training(tmp_path):
    out = tmp_path / "run"
    _refused(_fit("--out_dir", out, "--loop.lr", "1e300"), "`loop.lr`")
    assert not out.exists()


def test_no_recipe_hard_codes_its_run_directory():
    import yaml

    recipes = sorted((ROOT / "recipes").rglob("*.yaml"))
    assert recipes
    for path in recipes:
        cfg = yaml.safe_load(path.read_text()) or {}
        assert "out_dir" not in cfg, f"{path}: a fixed out_dir makes runs of other settings collide"


@pytest.mark.parametrize("flags", [["--overwrite", "true"], [], ["--resume", "auto"]])
def test_files_named_like_fedlights_that_it_did_not_write_are_never_replaced(tmp_path, flags):
    """Issue 50: another program's config.yaml and summary.json in the folder; `--overwrite true` replaced both."""
    out = tmp_path / "app"
    out.mkdir()
    (out / "config.yaml").write_text("name: my-app\n")
    (out / "summary.json").write_text('{"score": 1}\n')
    before = tree_hash(out)
    res = _fit("--out_dir", out, "--loop.rounds", 1, *flags)
    _refused(res, f"`out_dir` {out} holds files named like fedlight's that fedlight did not write: config.yaml (its "
                  "content is not what fedlight writes), summary.json (its content is not what fedlight writes); "
                  "move them away or choose another `--out_dir`")
    assert len([ln for ln in res.stderr.splitlines() if "error" in ln]) == 1, res.stderr
    assert tree_hash(out) == before and sorted(p.name for p in out.iterdir()) == ["config.yaml", "summary.json"]


def test_overwrite_still_clears_a_finished_run(tmp_path, done_run):
    out = tmp_path / "run"
    import shutil

    shutil.copytree(done_run, out)
    res = _fit("--out_dir", out, "--loop.rounds", 1, "--overwrite", "true")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [json.loads(ln)["round"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def _freeze(folder: Path, on: bool) -> None:
    """Make the folder itself read-only, for root too (the immutable flag), or writable again; its files stay
    writable."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i" if on else "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555 if on else 0o755)


def test_a_run_folder_made_read_only_mid_run_exits_74_in_one_line_then_resumes(tmp_path, monkeypatch):
    """Issue 60: the final model's write failed (RunDirError), then removing the lock file raised PermissionError
    over it: exit 1 (the README's "diverged"), two tracebacks."""
    import threading

    out, ready = tmp_path / "run", tmp_path / "ready"
    monkeypatch.setenv("FEDLIGHT_FAULT", "train@2:hold")  # the run holds in round 2 until the folder is frozen
    monkeypatch.setenv("FEDLIGHT_FAULT_READY", str(ready))

    def freeze_when_held():
        while not ready.exists():
            time.sleep(0.02)
        _freeze(out, True)
        ready.unlink()

    helper = threading.Thread(target=freeze_when_held, daemon=True)
    helper.start()
    try:
        res = _fit("--out_dir", out, "--loop.rounds", 3, "--loop.save_every", 1)
    finally:
        helper.join(60)
        _freeze(out, False)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 74 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len([ln for ln in lines if "error" in ln]) == 1 and lines[-1].startswith(
        f"fedlight fit: error: cannot write {out / 'final_model.pt'}: "), res.stderr[-3000:]
    assert lines[-1].endswith(f"The last complete checkpoint is {out / 'checkpoints' / 'last.ckpt'} (round 3).")
    monkeypatch.delenv("FEDLIGHT_FAULT", raising=False)  # (the hold took it)
    again = _fit("--out_dir", out, "--loop.rounds", 3, "--resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "final_model.pt").is_file() and not (out / ".fedlight.lock").exists()


def test_a_lock_file_that_cannot_be_removed_is_exit_74_naming_it(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("FEDLIGHT_FAULT", "write:.fedlight.lock:EROFS")
    res = _fit("--out_dir", out, "--loop.rounds", 2, "--loop.save_every", 1)
    assert res.returncode == 74 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"fedlight fit: error: cannot write {out / '.fedlight.lock'}: Read-only file system. Fix the folder (the lock "
        f"file left there is taken over by the next run). The last complete checkpoint is "
        f"{out / 'checkpoints' / 'last.ckpt'} (round 2).")
    monkeypatch.delenv("FEDLIGHT_FAULT")
    assert _fit("--out_dir", out, "--loop.rounds", 3, "--resume", "auto").returncode == 0  # the lock taken over


@pytest.mark.parametrize("flags", [["--resume", "auto"], ["--overwrite", "true", "--resume", "auto"],
                                   ["--overwrite", "true"], []])
def test_a_users_per_round_log_is_never_deleted(tmp_path, flags):
    """Issue 60: another tool's metrics.jsonl (first line a JSON object with a `round` key) was deleted, exit 0."""
    out = tmp_path / "app"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"round": 1, "reward": 0.5}\n{"round": 2, "reward": 0.7}\n')
    before = tree_hash(out)
    res = _fit("--out_dir", out, "--loop.rounds", 1, *flags)
    _refused(res, f"`out_dir` {out} holds a file named like fedlight's that fedlight did not write: metrics.jsonl (its "
                  "content is not what fedlight writes); move it away or choose another `--out_dir`")
    assert len([ln for ln in res.stderr.splitlines() if "error" in ln]) == 1, res.stderr
    assert tree_hash(out) == before and sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_a_run_without_its_config_still_owns_its_metrics(tmp_path, done_run):
    """The proof without config.yaml: the row an intact checkpoint carries; `--overwrite` clears the run."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(done_run, out)
    (out / "config.yaml").unlink()
    res = _fit("--out_dir", out, "--loop.rounds", 1, "--overwrite", "true")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [json.loads(ln)["round"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [1]
