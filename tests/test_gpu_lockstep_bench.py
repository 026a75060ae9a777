"""``tools/gpu_lockstep_bench.py --smoke``: the device benchmark of issue 57 runs whole on the CPU at a tiny size
(every section, the ratios against the pool measured in the same call, the JSON), so a GPU window only measures."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "tools/gpu_lockstep_bench.py", "--smoke", "--json", str(out), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    return res, out


def test_bench_smoke_runs_every_section(tmp_path):
    res, out = _bench(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log, got = res.stdout, json.loads(out.read_text())
    assert {(r["layer"], r["models"], r["layout"]) for r in got["conv"]} == {
        (c, m, lay) for c in ("conv1", "conv2") for m in (2, 3) for lay in ("nchw", "channels_last")} | {
        ("conv1", m, "im2col_bmm") for m in (2, 3)}
    assert all(r["tflops"] > 0 for r in got["conv"])
    assert set(got["routes"]) == {"eager", "eager+mm", "unions eager", "unions eager streams", "pool"}  # no compile
    assert "step  compiled: skipped" in log and "step  compiled+mm: skipped" in log  # and no MPS on the CPU
    assert "pool  with MPS: not measured" in log
    assert "unions compiled: skipped" in log and "unions eager    3 x 3 clients x 2 steps: one after another" in log
    assert "ratio pool         1.00 x today's pool without MPS" in log


def test_bench_sections_and_routes_as_asked(tmp_path):
    """``--sections step,profile --routes graphed+mm,eager``: those lines, the ratios to the first, the profile of
    the eager route only (a graph hides its kernels), nothing else; a wrong section is refused."""
    res, out = _bench(tmp_path, "--sections", "step,profile", "--routes", "graphed+mm,eager")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert list(got) == ["routes", "profile"] and list(got["routes"]) == ["graphed+mm", "eager"]
    assert "ratio graphed+mm    1.00 x graphed+mm" in res.stdout and "pool  " not in res.stdout
    assert list(got["profile"]) == ["eager"] and len(got["profile"]["eager"]["top"]) == 12
    assert 0 < got["profile"]["eager"]["busy_ms"] <= 1.5 * got["profile"]["eager"]["wall_ms"]
    assert "profile eager       3 clients:" in res.stdout
    res, _ = _bench(tmp_path, "--sections", "step,pools")
    assert res.returncode == 2 and "unknown --sections ['pools']" in res.stdout


def test_im2col_conv1_is_the_grouped_convolution():
    """The bench's ``im2col+bmm`` conv1 computes what the stacked grouped convolution computes (float64, 3 models)."""
    spec = importlib.util.spec_from_file_location("gpu_lockstep_bench", ROOT / "tools" / "gpu_lockstep_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    M, B = 3, 2
    torch.manual_seed(0)
    x = torch.randn(M, B, 3, 32, 32, dtype=torch.float64)
    w = torch.randn(M, 64, 3, 5, 5, dtype=torch.float64)
    grouped = F.conv2d(x.transpose(0, 1).reshape(B, M * 3, 32, 32), w.reshape(M * 64, 3, 5, 5), groups=M)
    want = grouped.view(B, M, 64, 28 * 28).permute(1, 2, 0, 3).reshape(M, 64, B * 28 * 28)
    got = bench.conv1_bmm(x.reshape(M * B, 3, 32, 32), w.reshape(M, 64, 75), M, B)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
