"""``tools/gpu_table.sh --smoke``: the prepared GPU run of FedNSAM Table 2's LeNet-5 CIFAR-10 column, whole, on the
CPU at a tiny size: a CIFAR-10 ImageFolder decoded to pickles, packed into parts and reassembled, the column's FedNSAM
row run through ``fedlight reproduce``, the table and the finished run packed under $OUT as
results/fednsam_table2_lenet5_cifar10/; then a fresh table folder restores that finished run and skips it, and a
call with a part still missing names it and runs nothing."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = "results/fednsam_table2_lenet5_cifar10"


def smoke(tmp_path: Path, out: str, **env) -> str:
    env = {**os.environ, "OUT": str(tmp_path / out), "SMOKE_DIR": str(tmp_path / "smoke"), "OMP_NUM_THREADS": "1",
           "PYTHON": sys.executable, **env}
    res = subprocess.run(["bash", "tools/gpu_table.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res.stdout


def test_gpu_table_smoke_runs_packs_and_resumes(tmp_path):
    log = smoke(tmp_path, "out")
    assert "unpacked and checked" in log and "[1/1] fednsam/lenet5_cifar10 seed0: done" in log
    with tarfile.open(tmp_path / "out" / "table.tar.gz") as tar:
        names = set(tar.getnames())
        run = f"{RES}/runs/fednsam/lenet5_cifar10/seed0"
        assert {f"{RES}/table.md", f"{RES}/table.csv", f"{run}/metrics.jsonl", f"{run}/summary.json"} <= names
        rows = [json.loads(line) for line in tar.extractfile(f"{run}/metrics.jsonl").read().decode().splitlines()]
        table = list(csv.DictReader(io.StringIO(tar.extractfile(f"{RES}/table.csv").read().decode())))
        tar.extractall(tmp_path / "back", filter="data")
    assert [r["round"] for r in rows] == [1, 2] and rows[-1]["test_acc"] is not None
    cells = {(r["cell"], r["metric"]): r for r in table}
    assert cells["fednsam/lenet5_cifar10", "final_test_acc"]["n"] == "1"
    assert float(cells["fednsam/lenet5_cifar10", "final_test_acc"]["mean"]) == 100 * rows[-1]["test_acc"]
    assert cells["fednsam/lenet5_cifar10_to78", "rounds_to_target:0.78"]["paper"] == "181"
    # A fresh machine: the table folder is gone; the finished run that came back is restored and not run again.
    (tmp_path / "smoke" / "runs").rename(tmp_path / "smoke" / "old_runs")
    log = smoke(tmp_path, "out2", RESTORE_FROM=str(tmp_path / "back" / RES / "runs"))
    assert "restored finished run" in log and "[1/1] fednsam/lenet5_cifar10 seed0: skipped" in log
    # A call that brings a part but not yet all of them (the first GPU call): it says which is missing, runs nothing.
    (tmp_path / "smoke" / "data").rename(tmp_path / "smoke" / "old_data")
    (tmp_path / "smoke" / "parts" / "cifar-10-batches-py.tar.xz.part01").unlink()
    log = smoke(tmp_path, "out3")
    assert "parts here; missing cifar-10-batches-py.tar.xz.part01" in log and "not every part here yet" in log
    assert "table:" not in log and not (tmp_path / "out3" / "table.tar.gz").exists()
