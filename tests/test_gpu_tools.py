"""The prepared GPU session runs its code on the CPU first: ``tools/gpu_check.sh --smoke`` and
``tools/gpu_profile.py --smoke`` at tiny sizes (correctness of the scripts only, never timing)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], tmp_path: Path) -> str:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res.stdout


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in output:\n{text[-3000:]}"
    return float(m.group(1))


def test_gpu_check_smoke_runs_every_new_path(tmp_path):
    pytest.importorskip("transformers")  # the LoRA step
    pytest.importorskip("timm")  # the Swin step
    out = _run(["bash", "tools/gpu_check.sh", "--smoke"], tmp_path)
    assert "done: 0 step(s) failed" in out
    for conv in ("one client's conv2d", "vmap's grouped conv (stacked)", "channels-last route"):
        assert f"paths: dtypes: {conv} under bf16 autocast on cpu: eager torch." in out
    assert "channels-last route under bf16 autocast on cpu: eager torch.bfloat16, compiled (aot_eager) " \
           "torch.bfloat16" in out  # the route convolves in bf16 as each client's own conv2d does, compiled too
    for algo in ("fedavg", "fedsam"):  # the LightningModule, both runners: the same model up to fp32 rounding
        assert f"paths: lightning {algo} sequential: runner sequential" in out
        assert f"paths: lightning {algo} vmap: runner stacked" in out
        assert _number(rf"lightning {algo}: stacked vs sequential final model, max \|diff\| (\S+) ", out) < 1e-6
    assert _number(r"paths: swin 64 px \+ RandAugment on cpu: .* ([\d.]+) s/step", out) > 0
    assert _number(r"vmap_chunk auto chose (\d+) of 3 clients", out) >= 1 and "fallbacks none" in out
    assert "compile_fail: trained by stacked, eager; fallback: torch.compile of the stacked step failed" in out
    assert _number(r"roberta-lora tiny .* (\d+) tokens/s", out.replace(",", "")) > 0
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"paths_log.txt", "lora_log.txt", "lora.json"}


def test_gpu_check_routes_smoke_measures_every_route_of_the_call_and_prints_the_table(tmp_path):
    from fedlight.lab.benchmarks.routes import FIRST_CALL

    out = _run(["bash", "tools/gpu_check.sh", "--routes", "--smoke"], tmp_path)
    assert "done: 0 step(s) failed" in out
    a = _number(r"\(a\) ([\d.]+) s", out)
    b = _number(r"\(b\) ([\d.]+) s", out)
    assert a > 0 and abs(b / a - _number(r"\(b\) [\d.]+ s = ([\d.]+) x \(a\)", out)) <= 0.05 * b / a + 0.02
    runners = {"stacked+graphs": "stacked, compiled",
               "stacked+channels_last+graphs": "stacked, channels-last, compiled",
               "stacked+graphs+bmm": "stacked, compiled, bmm from 1 channels",
               "stacked+graphs+halves": "stacked, compiled, two halves on two streams", "stacked": "stacked, compiled"}
    for route in FIRST_CALL:
        s = _number(rf"routes: {re.escape(route)} \[{re.escape(runners[route])}\]: ([\d.]+) s/round", out)
        ratio = _number(rf"routes: {re.escape(route)} \[.*?\]: [\d.]+ s/round, ([\d.]+) x \(a\)", out)
        assert abs(ratio - s / a) <= 0.05 * ratio + 0.02  # printed values are rounded
        assert "fallbacks 0" in out.split(f"routes: {route} [")[1].splitlines()[0]
        row = _number(rf"\| {re.escape(route)} \| [^|]+ \| [\d.]+ \| ([\d.]+) \| [\d.]+ % \|", out)  # the table
        assert abs(row - ratio) <= 0.011
        # bf16 rounds from the same start: the routes agree up to bf16 rounding
        assert _number(rf"routes: {re.escape(route)} .* vs first route (\S+)", out) < 1e-2
    assert "| anchor (a) | one model |" in out and re.search(r"profile: \S+: wall [\d.]+ s", out)
    assert "wgrad: triton: needs CUDA" in out and _number(r"wgrad: .* rel\. error dW (\S+),", out) < 1e-5


def cuda_only_tests(source: str) -> list[str]:
    """Test functions of ``source`` skipped without CUDA as a whole: a ``skipif``/``skip`` mark (or ``needs_cuda``) on
    the function or the module that names CUDA, or a ``pytest.skip`` under a condition that names CUDA in a test
    without a ``device`` parameter. A test that needs CUDA takes ``device`` from ``fedtest.DEVICES`` instead, so
    its body runs on CPU in CI and only the CUDA value is skipped."""
    import ast

    tree = ast.parse(source)

    def cuda_mark(node) -> bool:
        text = ast.unparse(node)
        skip = isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("skipif", "skip"))
        return "needs_cuda" in text or (skip and "cuda" in text.lower())

    module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                        and cuda_mark(n.value) for n in tree.body) or any(
        isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
        and isinstance(n.value, ast.List) and any(cuda_mark(e) for e in n.value.elts) for n in tree.body)
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test"):
            continue
        twin = "device" in [a.arg for a in fn.args.args]
        marked = module_marked or any(cuda_mark(d) for d in fn.decorator_list)
        skips = any(isinstance(n, ast.If) and "cuda" in ast.unparse(n.test).lower() and any(
            isinstance(c, ast.Call) and ast.unparse(c.func) == "pytest.skip" for c in ast.walk(n))
            for n in ast.walk(fn))
        if marked or (skips and not twin):
            out.append(fn.name)
    return out


def test_every_test_that_needs_cuda_has_a_cpu_twin():
    """Issue 42: a CUDA-only test drifted from the code (a changed signature) because CI never ran it."""
    found = {str(p.relative_to(ROOT)) + "::" + name for p in sorted((ROOT / "tests").rglob("*.py"))
             for name in cuda_only_tests(p.read_text())}
    assert found == set()
    stale = '''
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_old(route):
    pass

@pytest.mark.parametrize("device", DEVICES)
def test_new(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")

def test_inline():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
'''
    assert cuda_only_tests(stale) == ["test_old", "test_inline"]  # the guard bites on the old form
    assert cuda_only_tests("import pytest\npytestmark = pytest.mark.skipif(not HAVE_CUDA, reason='x')\n"
                           "def test_a(device):\n    pass\n") == ["test_a"]


def test_anchor_step_keeps_nothing_a_cuda_graph_produced():
    """Issue 42, anchor (b): the gradients (outputs of the backward graph) were kept as ``.grad`` into the next
    replay, which overwrote them. The step leaves no gradient behind, and it trains."""
    import torch

    from fedlight.lab.benchmarks.routes import single_model_step
    from fedlight.lab.benchmarks.workload import Workload

    w = Workload("lenet5", clients=2, steps=2, batch=4)
    step, model = single_model_step(w, torch.device("cpu"), 4, graphs=True)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        step()
        assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
