"""tools/bench.py in its tiny mode: every section runs and reports; correctness only, never timing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedlight.lab import bench, bench_cpu
from fedlight.lab.workload import Workload

ROOT = Path(__file__).resolve().parent.parent


def test_overhead_tiny_prints_a_ratio_line(capsys):
    assert bench.main(["--tiny", "--overhead", "--workloads", "mlp,lenet5"]) == 0
    out = capsys.readouterr().out
    assert "overhead mlp: fedlight" in out and "ratio" in out and "overhead lenet5" in out
    assert "vectorised mlp" in out and "command: python tools/bench.py --tiny" in out


def test_fit_wall_tiny_times_both_sides_alike_and_they_compute_the_same_model(tmp_path):
    """The default section: whole `fedlight fit` vs the hand-written loop, each in a fresh one-thread process."""
    res = bench.bench_fit.fit_wall(reps=1, rounds=2, tiny=True, workdir=str(tmp_path))
    assert res["threads"] == {"fit": [1], "minimal": [1]}
    assert res["max_abs_diff_final_model"] < 1e-5  # same seeds, batches, steps; float reduction order only
    assert res["final_test_acc"]["fit"] == res["final_test_acc"]["minimal"]
    fit = res["runs"]["fit"][0]
    assert fit["wall_s"] > 0 and fit["background_cpu_s"] >= 0 and len(res["ratios"]) == 1
    lines = bench.bench_fit.report_lines(res)
    assert "wall ratio fedlight fit / minimal median" in lines[0] and "spread" in lines[0]


def test_fedlight_minimal_and_vmap_rounds_compute_the_same_model():
    w = Workload("mlp", clients=3, steps=4, batch=8)
    res = bench_cpu.overhead(w, reps=2, warmup=1)
    assert res["max_abs_diff_fedlight_vs_minimal"] < 1e-5  # same batches, same steps; fp32 reduction order only
    assert res["max_abs_diff_vmap_vs_minimal"] < 1e-5
    assert set(res["s_per_round"]) == {"fedlight", "minimal", "vmap"}


def test_many_clients_tiny_spills_and_matches_in_memory():
    res = bench_cpu.many_clients(num_clients=30, budget_mb=1.0, rounds=1, samples=2, clients_per_round=4)
    assert res["spilled_clients"] > 20 and res["in_memory_mb"] <= 1.0
    assert res["max_abs_diff_spilled_vs_memory"] == 0.0  # spilling changes where c_i lives, never its bits
    assert res["peak_rss_mb"] > 0


def test_gpu_section_says_when_it_cannot_run_and_its_code_runs_on_cpu():
    import torch

    if not torch.cuda.is_available():
        assert "skipped" in bench.gpu(reps=1, warmup=0, variants=("fedavg",), clients=2, steps=2, batch=4)
    variants = ("fedavg", "fedavg+sequential", "fedavg+vmap", "fedsam+bn")
    cpu = bench.gpu(reps=1, warmup=0, variants=variants, clients=2, steps=1, batch=2, accelerator="cpu")
    rows = cpu["rows"]
    assert [r["variant"] for r in rows] == list(variants) and all("error" not in r for r in rows), rows
    assert rows[0]["x_fedavg"] == 1.0 and rows[0]["runner"].startswith("sequential (auto: cpu device")
    assert rows[2]["runner"].startswith("stacked") and rows[0]["mfu_h100_bf16"] > 0
    assert "s/round" in bench.report({"command": "x", "environment": bench.environment(), "gpu": cpu})


@pytest.mark.skipif(sys.platform != "linux", reason="os.wait4 / gloo on CPU")
def test_multiprocess_tiny_1_and_2_processes_agree(tmp_path):
    res = bench_cpu.multiprocess(rounds=1, steps=2, workdir=str(tmp_path), tiny=True)
    assert res["max_abs_diff_final_model"] < 1e-6
    assert 0 <= res["eval_share"][1] <= 1 and res["rank0_peak_rss_mb"][2] > 0


def test_cli_wrapper_help():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--many-clients" in out.stdout


def test_cli_table_resolves_fedlight_bench():
    from fedlight.config import cli
    assert "bench" in cli.USAGE and cli.command("bench") is bench.cmd_bench


def test_gpu_busy_counts_each_kernel_once():
    """The profiler lists a kernel as its own event and again inside its launching CPU operator's device total;
    the bench's GPU-busy seconds must be the kernels' durations alone (the first H100 run printed twice that)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from fedlight.lab.bench_gpu import kernel_seconds

    def event(kind, us):
        return SimpleNamespace(device_type=kind, name="k", time_range=SimpleNamespace(elapsed_us=lambda: us),
                               device_time_total=us)

    prof = SimpleNamespace(events=lambda: [event(DeviceType.CPU, 30.0), event(DeviceType.CUDA, 30.0),
                                           event(DeviceType.CUDA, 12.0)])
    busy, kernels = kernel_seconds(prof)
    assert busy == pytest.approx(42e-6) and len(kernels) == 2


def test_peer_benchmark_smoke_runs_the_same_work_on_each_side(capsys):
    """``fedlight bench --peers --smoke``: fedlight's own ``fit`` and the minimal loop (pfl where installed) train the
    same clients from the same weights, so after 2 rounds of one full-batch step their test accuracies agree."""
    from fedlight.lab.bench_peers import cmd_peers, pfl_available

    assert cmd_peers(["--smoke"]) == 0
    out, err = capsys.readouterr()
    rows = {r[0]: r for r in map(str.split, out.splitlines()) if len(r) == 6 and r[0] in ("fedlight", "minimal", "pfl")}
    assert abs(float(rows["fedlight"][-1]) - float(rows["minimal"][-1])) <= 0.004, out  # 2 of the 500 test images
    assert "fedlight / minimal: median round ratio over 1 pairs" in out
    assert ("pfl" in rows) == pfl_available(None) and (("skipped" in err) != pfl_available(None)), (out, err)
