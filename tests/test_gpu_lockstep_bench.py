"""``tools/gpu_lockstep_bench.py --smoke``: the device benchmark of issue 57 runs whole on the CPU at a tiny size
(every section, the ratios against the pool measured in the same call, the JSON), so a GPU window only measures."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_smoke_runs_every_section(tmp_path):
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "tools/gpu_lockstep_bench.py", "--smoke", "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log, got = res.stdout, json.loads(out.read_text())
    assert {(r["layer"], r["models"], r["layout"]) for r in got["conv"]} == {
        (c, m, lay) for c in ("conv1", "conv2") for m in (2, 3) for lay in ("nchw", "channels_last")}
    assert all(r["tflops"] > 0 for r in got["conv"])
    assert set(got["routes"]) == {"eager", "graphed", "pool"}  # no compile and no MPS on the CPU: one line each
    assert "step  compiled: skipped" in log and "pool  with MPS: not measured" in log
    assert "ratio pool         1.00 x today's pool without MPS" in log
