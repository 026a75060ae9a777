"""``tools/bench.py --gpu``: a ResNet-18-CIFAR federated round on one GPU, per rule and per client runner.

Each variant is ``algorithm[+switch...]``; with no switch the loop picks its runner as ``fedlight fit`` does
(``loop.client_parallelism: auto``). Switches: ``sequential`` / ``vmap`` (eager stacked) force a runner,
``reduce-overhead`` compiles the stacked loss with CUDA graphs, ``channels_last``, ``bn`` (BatchNorm ResNet-18,
FedAdamW's paper model; GroupNorm otherwise, the recipes' model). Per variant: seconds per round (median of the
timed rounds), the first round (compilation included), achieved TFLOP/s and MFU against the H100's dense bf16
peak (FLOPs counted once per model with ``torch.utils.flop_counter`` times the rule's backward passes per step),
host CPU seconds per round, GPU-busy seconds of one profiled round (sum of kernel time; stacked runners only) and
peak GPU memory.
Ratios are taken against the ``fedavg`` (auto) row of the same run.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import time
from typing import Any

import torch
import torch.nn.functional as F

H100_BF16_PEAK = 989.4e12  # FLOP/s, dense (SXM)

GPU_VARIANTS = ("fedavg", "fedavg+sequential", "fedavg+vmap", "fedwmsam", "fednsam", "fedswa", "fedmoswa", "fedadamw",
                "fedcm", "fedsam", "fedgamma", "fedsmoo", "mofedsam", "fedavg+bn", "fedavg+bn+vmap",
                "fedavg+reduce-overhead")


def flop_per_sample(model: torch.nn.Module, shape: tuple[int, ...], num_classes: int, device) -> float:
    """Forward + backward FLOPs of one sample (counted on a batch of 8, eager)."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(8, *shape, device=device)
    y = torch.randint(0, num_classes, (8,), device=device)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 8


def kernel_seconds(prof) -> tuple[float, list]:
    """The summed durations of the GPU kernels a ``torch.profiler`` run recorded, and those kernel events (CPU
    operators' device-time totals would count each kernel twice: under its launching operator and as itself)."""
    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e6, kernels


def gpu_busy_s(loop, r: int) -> float | None:
    """Kernel time of one profiled round (None when the profiler is unavailable). The profiler slows kernels
    down too (1.33 s rounds showed 2.46 s of kernels on an H100): read it as a share, not as seconds saved."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loop.run_round(r)
            torch.cuda.synchronize()
        return kernel_seconds(prof)[0]
    except Exception:  # noqa: BLE001 - a diagnostic; the timing rows stand without it
        return None


def _nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,power.limit,clocks.max.sm,memory.total,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi unavailable"


def gpu(reps: int = 5, warmup: int = 2, variants: tuple[str, ...] = GPU_VARIANTS, clients: int = 10,
        steps: int = 50, batch: int = 50, accelerator: str = "cuda") -> dict[str, Any]:
    """Every variant on the same data; ``accelerator="cpu"`` is a smoke test of this section (MFU meaningless)."""
    from fedlight.lab.benchmarks.workload import Workload
    from fedlight.models import ResNet18

    cuda = accelerator == "cuda"
    if cuda and not torch.cuda.is_available():
        return {"skipped": "no CUDA device: run `python tools/bench.py --gpu` on a machine with one"}
    w = Workload("resnet18", clients=clients, steps=steps, batch=batch)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "cuda": torch.version.cuda,
                           "nvidia_smi": _nvidia_smi() if cuda else "-", "clients": clients, "steps": steps,
                           "batch": batch, "precision": "bf16-mixed", "rows": []}
    clients_data = w.data()
    models: dict[str, tuple[torch.nn.Module, dict, float]] = {}  # one instance per norm: compiled code is reused
    for variant in variants:
        algo, *switches = variant.split("+")
        norm = "batch" if "bn" in switches else "group"
        if norm not in models:
            torch.manual_seed(w.seed)
            m = ResNet18(num_classes=100, norm=norm).to(accelerator)
            models[norm] = (m, {k: v.clone() for k, v in m.state_dict().items()},
                            flop_per_sample(m, w.shape, 100, accelerator))
        model, init, fps = models[norm]
        model.load_state_dict(init)
        try:
            row = _variant(variant, algo, switches, model, fps, clients_data, w, accelerator, reps, warmup)
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others' numbers
            row = {"variant": variant, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        res["rows"].append(row)
        print("gpu-row " + json.dumps(row), flush=True)
    base = next((r for r in res["rows"] if r["variant"] == "fedavg" and "s_per_round" in r), None)
    for r in res["rows"]:
        if base is not None and "s_per_round" in r:
            r["x_fedavg"] = r["s_per_round"] / base["s_per_round"]
    return res


def _variant(variant, algo, switches, model, fps, clients_data, w, accelerator, reps, warmup) -> dict[str, Any]:
    from fedlight import get_algorithm  # fedlight's own rules registered first
    from fedlight.lab.benchmarks.workload import fedlight_loop, timed

    cuda = accelerator == "cuda"
    mode = "sequential" if "sequential" in switches else "vmap" if "vmap" in switches else "auto"
    kw = {"channels_last": "channels_last" in switches, "parallelism": mode}
    if "reduce-overhead" in switches:
        kw.update(parallelism="vmap", compile="reduce-overhead")
    elif mode == "vmap":
        kw["compile"] = False
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    loop = fedlight_loop(model, clients_data, w, accelerator, "bf16-mixed", algo, **kw)
    dev = loop.device
    t0 = time.perf_counter()
    first = timed(lambda: loop.run_round(0), dev)[0]
    times = [timed(lambda r=r: loop.run_round(r), dev) for r in range(1, 1 + warmup + reps)][warmup:]
    s = statistics.median(t for t, _ in times)
    flops = w.clients * w.steps * w.batch * fps * get_algorithm(algo).backprops
    row = {"variant": variant, "runner": f"{loop.runner.name} ({loop.runner_reason})",
           "compiled": str(kw.get("compile", "auto")), "s_per_round": s, "first_round_s": first,
           "host_cpu_s_per_round": statistics.median(c for _, c in times), "tflops": flops / s / 1e12,
           "mfu_h100_bf16": flops / s / H100_BF16_PEAK,
           "peak_gpu_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
           "setup_s": time.perf_counter() - t0}
    if cuda and loop.runner.name == "stacked":  # a sequential round has ~700k kernels: minutes to post-process
        row["gpu_busy_s"] = gpu_busy_s(loop, 1 + warmup + reps)
    shutil.rmtree(loop.out_dir, ignore_errors=True)
    return row


def report_lines(gres: dict[str, Any]) -> list[str]:
    if "skipped" in gres:
        return [f"gpu: {gres['skipped']}"]
    out = [f"gpu: {gres['device']} ({gres['nvidia_smi']}; CUDA {gres['cuda']}); ResNet-18-CIFAR-100, "
           f"{gres['clients']} clients x {gres['steps']} steps x batch {gres['batch']}, {gres['precision']}",
           "| variant | runner | s/round | x fedavg | first round s | TFLOP/s | MFU | host CPU s | GPU busy s | "
           "peak GB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in gres["rows"]:
        if "error" in r:
            out.append(f"| {r['variant']} | failed: {r['error']} |||||||||")
            continue
        busy = "-" if r.get("gpu_busy_s") is None else f"{r['gpu_busy_s']:.3f}"
        out.append(f"| {r['variant']} | {r['runner']} | {r['s_per_round']:.3f} | {r.get('x_fedavg', float('nan')):.2f} "
                   f"| {r['first_round_s']:.1f} | {r['tflops']:.1f} | {100 * r['mfu_h100_bf16']:.1f}% | "
                   f"{r['host_cpu_s_per_round']:.3f} | {busy} | {r['peak_gpu_mem_gb']:.2f} |")
    return out
