"""tools/bench.py in its tiny mode: every section runs and reports; correctness only, never timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedlight.lab.benchmarks import cli as bench
from fedlight.lab.benchmarks import cpu as bench_cpu
from fedlight.lab.benchmarks.workload import Workload

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

    from fedlight.lab.benchmarks.gpu import kernel_seconds

    def event(kind, us):
        return SimpleNamespace(device_type=kind, name="k", time_range=SimpleNamespace(elapsed_us=lambda: us),
                               device_time_total=us)

    prof = SimpleNamespace(events=lambda: [event(DeviceType.CPU, 30.0), event(DeviceType.CUDA, 30.0),
                                           event(DeviceType.CUDA, 12.0)])
    busy, kernels = kernel_seconds(prof)
    assert busy == pytest.approx(42e-6) and len(kernels) == 2


def test_peer_benchmark_smoke_runs_the_same_work_on_each_side(capsys, monkeypatch):
    """``fedlight bench --peers --smoke``: fedlight's own ``fit`` and the minimal loop (pfl where installed) train the
    same clients from the same weights, so after 2 rounds of one full-batch step their test accuracies agree. Every
    side is timed by the one clock: its 2 round ends are ticks of ``time.monotonic`` inside the driver's readings
    around its process (fedlight's too: not its own metrics.jsonl's times)."""
    from fedlight.lab.benchmarks import peers as bench_peers
    from fedlight.lab.benchmarks.peers import cmd_peers, pfl_available

    seen = {}
    monkeypatch.setattr(bench_peers, "report", lambda runs, spec, real=bench_peers.report: seen.update(runs) or
                        real(runs, spec))
    assert cmd_peers(["--smoke"]) == 0
    out, err = capsys.readouterr()
    rows = {r[0]: r for r in map(str.split, out.splitlines()) if len(r) == 7 and r[0] in ("fedlight", "minimal", "pfl")}
    assert abs(float(rows["fedlight"][-1]) - float(rows["minimal"][-1])) <= 0.004, out  # 2 of the 500 test images
    assert "fedlight / minimal: median round ratio over 1 pairs" in out
    assert "criterion fedlight / minimal round <= 1.03: cannot decide: 1 pair(s) give no 95% interval" in out
    assert ("pfl" in rows) == pfl_available(None) and (("skipped" in err) != pfl_available(None)), (out, err)
    for side, (r,) in seen.items():
        a, b = r["ticks"]
        assert r["rounds_s"] == [b - a] and "round_time_s" not in json.dumps(r), side
        assert 0 < r["first_s"] and 0 < r["last_s"] and r["first_s"] + (b - a) + r["last_s"] == pytest.approx(
            r["wall_s"])


@pytest.mark.parametrize("n, k, coverage", [(5, None, None), (6, 1, 1 - 2 / 64), (8, 1, 1 - 2 / 256),
                                            (9, 2, 1 - 2 * 10 / 512), (17, 5, 1 - 2 * 3214 / 2 ** 17)])
def test_peer_benchmark_interval_of_the_median_is_the_binomial_order_statistics(n, k, coverage):
    """The pairs' 95 % interval: order statistics k and n + 1 - k, k the largest with P(Bin(n, ½) < k) ≤ 2.5 %
    (n = 17: P(Bin < 5) = (1 + 17 + 136 + 680 + 2380) / 2^17 = 0.0245; P(Bin < 6) = 0.0717)."""
    from fedlight.lab.benchmarks.peers import median_interval

    xs = [1 + i / 100 for i in range(n)][::-1]  # given in any order
    got = median_interval(xs)
    assert got == (None if k is None else (pytest.approx(xs[-k]), pytest.approx(xs[k - 1]), pytest.approx(coverage)))


def test_peer_benchmark_says_when_it_cannot_decide():
    from fedlight.lab.benchmarks.peers import verdict

    assert verdict([0.95, 0.97, 0.98, 0.99, 1.0, 1.01], "<=", 1.03).startswith(
        "met: the 96.9% interval [0.950, 1.010] over 6 pairs lies below 1.03")
    assert verdict([0.95, 0.97, 0.98, 0.99, 1.0, 1.05], "<=", 1.03).startswith("cannot decide: the 96.9% interval")
    assert verdict([1.1, 1.2, 1.3, 1.25, 1.15, 1.06], ">=", 1.05).startswith("met: ")
    assert verdict([1.1, 1.2, 1.3, 1.25, 1.15, 1.06], "<=", 1.05).startswith("not met: ")
    assert verdict([0.9] * 5, "<=", 1.03).startswith("cannot decide: 5 pair(s) give no 95% interval")
