"""``tools/gpu_table.sh --smoke``: the prepared GPU run of FedNSAM Table 2's LeNet-5 CIFAR-10 column, whole, on the
CPU at a tiny size: a CIFAR-10 ImageFolder decoded to pickles, packed into parts and reassembled, the column's FedNSAM
and SCAFFOLD rows run through ``fedlight reproduce``, the table and the finished runs packed under $OUT as
results/fednsam_table2_lenet5_cifar10/. A run stopped at the limit comes back in resume.tar.gz (its checkpoint and
SCAFFOLD's client-state files); a fresh table folder restores it and the finished runs, and the resumed run ends bit
for bit where the uninterrupted one ended. A restore never replaces a run that is finished or further along; a call
with a part still missing names it and runs nothing."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RES = "results/fednsam_table2_lenet5_cifar10"
SCAFFOLD = "scaffold/lenet5_cifar10/seed0"
_spec = importlib.util.spec_from_file_location("resume_runs", ROOT / "tools" / "resume_runs.py")
resume_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(resume_runs)


def smoke(tmp_path: Path, out: str, stop_when: Path | None = None, args: tuple = (), **env) -> str:
    """Run the smoke; with ``stop_when``, fire its limit (SIGALRM to its ``timeout``) once that file exists."""
    env = {**os.environ, "OUT": str(tmp_path / out), "SMOKE_DIR": str(tmp_path / "smoke"), "OMP_NUM_THREADS": "1",
           "PYTHON": sys.executable, **env}
    p = subprocess.Popen(["bash", "tools/gpu_table.sh", "--smoke", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        if stop_when is not None:
            while not stop_when.exists() and p.poll() is None:
                time.sleep(0.1)
            if p.poll() is None:  # else its log says why it ended
                os.kill(next(pid for pid in children(p.pid) if comm(pid) == "timeout"), signal.SIGALRM)
        log = p.communicate(timeout=600)[0]
    finally:
        p.kill()
    assert p.returncode == 0, log[-6000:]
    return log


def children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def table_dir(tmp_path: Path) -> Path:
    return tmp_path / "smoke" / "runs" / "fednsam_table2_lenet5_cifar10"


def set_aside(tmp_path: Path, name: str) -> Path:
    """The smoke's table folder moved aside (a fresh machine has none); returns where it went."""
    return table_dir(tmp_path).rename(tmp_path / name)


def same_model(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_gpu_table_smoke_runs_packs_and_resumes(tmp_path):
    cells = "fednsam/lenet5_cifar10,fednsam/lenet5_cifar10_to78,scaffold/lenet5_cifar10"
    log = smoke(tmp_path, "out", SMOKE_CELLS=cells)
    assert "unpacked and checked" in log and "fednsam/lenet5_cifar10 seed0: done" in log
    assert "scaffold/lenet5_cifar10 seed0: done" in log and "resume: no unfinished run with a checkpoint" in log
    with tarfile.open(tmp_path / "out" / "table.tar.gz") as tar:
        names = set(tar.getnames())
        run = f"{RES}/runs/fednsam/lenet5_cifar10/seed0"
        assert {f"{RES}/table.md", f"{RES}/table.csv", f"{run}/metrics.jsonl", f"{run}/summary.json"} <= names
        rows = [json.loads(line) for line in tar.extractfile(f"{run}/metrics.jsonl").read().decode().splitlines()]
        table = list(csv.DictReader(io.StringIO(tar.extractfile(f"{RES}/table.csv").read().decode())))
        tar.extractall(tmp_path / "back", filter="data")
    assert [r["round"] for r in rows] == [1, 2, 3] and rows[-1]["test_acc"] is not None
    cells_of = {(r["cell"], r["metric"]): r for r in table}
    assert cells_of["fednsam/lenet5_cifar10", "final_test_acc"]["n"] == "1"
    assert float(cells_of["fednsam/lenet5_cifar10", "final_test_acc"]["mean"]) == 100 * rows[-1]["test_acc"]
    assert cells_of["fednsam/lenet5_cifar10_to78", "rounds_to_target:0.78"]["paper"] == "181"
    whole = set_aside(tmp_path, "whole")  # the uninterrupted runs

    # The limit fires while SCAFFOLD is in round 2: the run stops after it and comes back in resume.tar.gz.
    ready = tmp_path / "in_round_2"
    log = smoke(tmp_path, "out_stop", stop_when=ready, SMOKE_CELLS="scaffold/lenet5_cifar10",
                FEDLIGHT_FAULT="train@2:pause", FEDLIGHT_FAULT_READY=str(ready))
    assert "reproduce exit 124: stopped at the limit" in log and "seed0: stopped" in log
    # SCAFFOLD keeps one 3.2 MB state file per client it has sampled (3 a round): over 16 MiB, in 15 MiB parts.
    parts = sorted((tmp_path / "out_stop").glob("resume.tar.gz*"))
    assert [p.name for p in parts] == ["resume.tar.gz.part01", "resume.tar.gz.part02"]
    assert parts[0].stat().st_size == resume_runs.PART and "resume: 1 unfinished runs in resume.tar.gz.part01" in log
    assert f"{SCAFFOLD} (round 2," in log and len(list((tmp_path / "out_stop").iterdir())) == 5
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        names = tar.getnames()
    stopped = set_aside(tmp_path, "stopped")
    states = sorted((stopped / SCAFFOLD / "client_state" / "rank0").glob("*.bin"))
    assert states and {f"{SCAFFOLD}/{n}" for n in ("checkpoints/last.ckpt", "metrics.jsonl", "config.yaml",
                                                   "reproduce.json", "job.json")} <= set(names)
    assert {n for n in names if "/client_state/" in n} == {f"{SCAFFOLD}/client_state/rank0/{p.name}" for p in states}
    assert not any(n.endswith(("prev.ckpt", "fit.log")) or "/tb/" in n for n in names)

    # A fresh machine: the finished FedNSAM run from results/ and the stopped SCAFFOLD run from .gpu/resume come back;
    # FedNSAM is skipped, SCAFFOLD resumes at round 3 and ends as the uninterrupted run did.
    (tmp_path / "smoke" / "resume").mkdir()
    for part in parts:  # as after a window: mkdir -p .gpu/resume && cp <files_at>/resume.tar.gz* .gpu/resume/
        shutil.copy(part, tmp_path / "smoke" / "resume")
    shutil.rmtree(tmp_path / "back" / RES / "runs" / "scaffold")  # committed: FedNSAM only
    log = smoke(tmp_path, "out2", RESTORE_FROM=str(tmp_path / "back" / RES / "runs"), SMOKE_CELLS=cells)
    assert "restored finished run" in log and "fednsam/lenet5_cifar10 seed0: skipped" in log
    assert f"resume: {SCAFFOLD}: restored at round 2" in log and "scaffold/lenet5_cifar10 seed0: done" in log
    resumed = table_dir(tmp_path) / SCAFFOLD
    assert [json.loads(x)["round"] for x in (resumed / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert "resumed from round 2" in (resumed / "fit.log").read_text()
    assert same_model(resumed / "final_model.pt", whole / SCAFFOLD / "final_model.pt")

    # A call that brings a part but not yet all of them (the first GPU call): it says which is missing, runs nothing.
    (tmp_path / "smoke" / "data").rename(tmp_path / "smoke" / "old_data")
    (tmp_path / "smoke" / "parts" / "cifar-10-batches-py.tar.xz.part01").unlink()
    log = smoke(tmp_path, "out3")
    assert "parts here; missing cifar-10-batches-py.tar.xz.part01" in log and "not every part here yet" in log
    assert "table:" not in log and not (tmp_path / "out3" / "table.tar.gz").exists()

    check_restore_rules(tmp_path, whole, stopped, table_dir(tmp_path))


def test_gpu_table_first_call_benches_then_starts_only_stateful_rows_that_finish(tmp_path):
    """The window's first call (``--bench``): the benchmark and the CUDA values of the exactness tests (none on a
    CPU), then the plan: SCAFFOLD's 3 rounds at a measured 1000 s a round do not fit the call, so it is not started
    (its client states could not come back); FedNSAM, stateless, runs."""
    log = smoke(tmp_path, "out", args=("--bench",), SMOKE_CELLS="fednsam/lenet5_cifar10,scaffold/lenet5_cifar10",
                STATEFUL_S_PER_ROUND="1000")
    assert "bench exit 0: bench:" in log and "ratio pool         1.00 x today's pool without MPS" in log
    assert "cuda tests exit" in log and (tmp_path / "out" / "bench.json").is_file()
    assert "stateful first: scaffold/lenet5_cifar10" in log
    assert "stateful rows not started: 3 rounds at 1000 s/round do not fit" in log
    assert "fednsam/lenet5_cifar10 seed0: done" in log and "scaffold/lenet5_cifar10 seed0" not in log
    assert not (table_dir(tmp_path) / SCAFFOLD).exists()


def test_gpu_table_bench_only_with_the_benchmarks_flags_and_no_tests(tmp_path):
    """``--bench-only`` with ``BENCH_ARGS`` and ``CUDA_TESTS=0``: the asked sections only; no tests, data or table."""
    log = smoke(tmp_path, "out", args=("--bench-only",), BENCH_ARGS="--sections step --routes eager,eager+mm",
                CUDA_TESTS="0")
    assert "bench --sections step --routes eager,eager+mm" in log and "bench exit 0: bench:" in log
    assert "step  eager+mm 3 clients" in log and "ratio eager+mm" in log
    assert "cuda tests" not in log and "data" not in log.split("bench exit 0")[1]
    assert not (tmp_path / "out" / "cuda_tests.txt").exists() and not table_dir(tmp_path).exists()


def check_restore_rules(tmp_path: Path, whole: Path, stopped: Path, finished: Path) -> None:
    """The archive (SCAFFOLD at round 2) never replaces a run finished or further along; a part missing is refused;
    a run that does not fit is left out, named; one that fits 16 MiB comes back as one file."""
    src = tmp_path / "smoke" / "resume"
    ahead = tmp_path / "ahead"
    shutil.copytree(whole, ahead)
    (ahead / SCAFFOLD / "summary.json").unlink()  # unfinished, its checkpoint at round 3
    for table, why in ((finished, "kept (finished here)"),
                       (ahead, "kept (here at round 3; the archive's is at round 2)"),
                       (stopped, "kept (here at round 2; the archive's is at round 2)")):
        before = {p: p.read_bytes() for p in (table / SCAFFOLD).rglob("*") if p.is_file()}
        out = run_tool("restore", src, table)
        assert f"resume: {SCAFFOLD}: {why}" in out
        assert {p: p.read_bytes() for p in (table / SCAFFOLD).rglob("*") if p.is_file()} == before

    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "resume.tar.gz.part02").unlink()  # the tail missing
    with pytest.raises(resume_runs.ResumeError, match="incomplete or damaged"):
        resume_runs.restore(broken, tmp_path / "fresh")
    (broken / "resume.tar.gz.part01").rename(broken / "resume.tar.gz.part02")
    with pytest.raises(resume_runs.ResumeError, match="are not part01"):
        resume_runs.restore(broken, tmp_path / "fresh")

    out = run_tool("pack", stopped, tmp_path / "out_stop", CALL_BYTES=4 << 20)
    assert "LEFT OUT, no room in" in out and f"{SCAFFOLD} (round 2" in out
    assert not list((tmp_path / "out_stop").glob("resume*"))
    run = whole / "fednsam/lenet5_cifar10/seed0"  # unfinished, only a prev.ckpt (killed between the two renames)
    (run / "summary.json").unlink()
    (run / "checkpoints" / "last.ckpt").rename(run / "checkpoints" / "prev.ckpt")
    out = run_tool("pack", whole, tmp_path / "out_small")
    assert "resume: 1 unfinished runs in resume.tar.gz (" in out
    assert [p.name for p in (tmp_path / "out_small").iterdir()] == ["resume.tar.gz"]
    with tarfile.open(tmp_path / "out_small" / "resume.tar.gz") as tar:
        assert "fednsam/lenet5_cifar10/seed0/checkpoints/prev.ckpt" in tar.getnames()


def run_tool(cmd: str, a: Path, b: Path, **constants) -> str:
    """``tools/resume_runs.py cmd a b`` in this process (with smaller limits), its printed lines."""
    saved = {k: getattr(resume_runs, k) for k in constants}
    buf, stdout = io.StringIO(), sys.stdout
    try:
        for k, v in constants.items():
            setattr(resume_runs, k, v)
        sys.stdout = buf
        assert resume_runs.main([cmd, str(a), str(b)]) == 0
    finally:
        sys.stdout = stdout
        for k, v in saved.items():
            setattr(resume_runs, k, v)
    return buf.getvalue()


@pytest.mark.parametrize("lockstep", ["1", "column"])
def test_gpu_table_smoke_in_lockstep(lockstep, tmp_path):
    """``LOCKSTEP=1`` (what ``auto`` is on the GPU) and ``column`` (with ``MPS=1``, which a machine without MPS
    declines in one line): the seeds train as one lockstep group through the script's own ``fedlight reproduce``
    line, and every run finishes."""
    log = smoke(tmp_path, "out", SMOKE_CELLS="fednsam/lenet5_cifar10", SMOKE_SEEDS="2", LOCKSTEP=lockstep,
                **({"MPS": "1"} if lockstep == "column" else {}))
    assert f"--lockstep {'on' if lockstep == '1' else 'column'}" in log and "the phase failed in lockstep" not in log
    assert ("MPS: not used (no nvidia-cuda-mps-control here)" in log) == (lockstep == "column")
    assert "fednsam/lenet5_cifar10 seed0: done" in log and "fednsam/lenet5_cifar10 seed1: done" in log
    for seed in (0, 1):
        rows = (table_dir(tmp_path) / f"fednsam/lenet5_cifar10/seed{seed}" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["round"] for x in rows] == [1, 2, 3]
