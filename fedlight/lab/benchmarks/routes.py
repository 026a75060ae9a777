"""The round against the hardware's own bound, and the client routes side by side (``tools/gpu_profile.py`` sections
``anchor`` and ``routes``; issue 31).

``anchor``: the round's images (clients × steps × batch, 25,000 for ResNet-18-CIFAR) through *one* model, the
same one (GroupNorm ResNet-18), bf16 autocast, compiled, channels-last, SGD with the loop's weight decay:
(a) ``steps`` steps at batch ``clients × batch`` — the round's arithmetic in its most favourable single-model form;
(b) ``clients × steps`` steps at batch ``batch`` with CUDA graphs (``mode="reduce-overhead"``) — the sequential
form. The goal is stated against (a): a round ≤ 1.3 × (a) measured in the same call (issue 42).

``routes``: FedAvg rounds of the same workload under each client route (:data:`ROUTES`): s/round (median), the
compiling first round, ratio to anchor (a) when measured in the same process, TFLOP/s and MFU (dense bf16 peak of
an H100/H200), peak memory, and the largest difference of the model after round 0 from the first route's (bf16:
rounding-sized differences are expected; exactness is tested in fp32/fp64 by ``tests/loop/test_runner_routes.py``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

ROUTES: dict[str, dict[str, Any]] = {  # in the order a short device window should measure them
    "stacked+graphs": {"parallelism": "vmap", "compile": "reduce-overhead"},  # auto's route on CUDA (issue 42)
    "stacked+channels_last+graphs": {"parallelism": "vmap", "compile": "reduce-overhead", "channels_last": True},
    "stacked+graphs+bmm": {"parallelism": "vmap", "compile": "reduce-overhead", "candidate": "bmm"},
    "stacked+graphs+halves": {"parallelism": "vmap", "compile": "reduce-overhead", "candidate": "halves"},
    "stacked": {"parallelism": "vmap", "compile": True},
    "stacked+channels_last": {"parallelism": "vmap", "compile": True, "channels_last": True},
    "streams+graphs": {"parallelism": "streams", "compile": "reduce-overhead", "channels_last": True},
    "sequential+compiled": {"parallelism": "sequential", "compile": True, "channels_last": True},
    "stacked+whole-step-graphs": {"parallelism": "graphs", "compile": False},  # issue 57: not measured yet
}
"""Route name → ``fedlight_loop`` keywords (``compile`` is replaced by ``smoke_backend`` on CPU); ``candidate``: a
runner of :mod:`fedlight.lab.benchmarks.route_candidates` put in the stacked runner's place. Streams eager and streams
compiled are gone (issue 42: slower than sequential + compiled on an H200)."""

FIRST_CALL = ("stacked+graphs", "stacked+channels_last+graphs", "stacked+graphs+bmm", "stacked+graphs+halves",
              "stacked")
"""The routes ``tools/gpu_check.sh --routes`` measures: auto's route, then the three candidates past it, then the
default of the issue's table (the rest were measured in issue 42, ``fedlight.runners.choice.MEASURED``)."""

MEASURED: dict[str, float] = {}
"""Seconds measured in this process (``anchor_a``, ``anchor_b``), read by later sections."""


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _compile_kw(compile: bool | str, dev: torch.device, smoke_backend: str) -> dict[str, Any]:
    if dev.type != "cuda":
        return {"backend": smoke_backend}
    return {"mode": compile} if isinstance(compile, str) else {}


def single_model_step(w, dev: torch.device, batch: int, graphs: bool, smoke_backend: str = "aot_eager"):
    """One compiled bf16 channels-last SGD step of one ``w.model()`` at ``batch`` (the anchor's unit of work), and
    the model. With ``graphs`` the model's forward and backward run as CUDA graphs (``reduce-overhead``); the
    optimizer step is compiled without graphs.

    Nothing a graph produced outlives the step (issue 42: anchor (b) died with "accessing tensor output of CUDAGraphs
    that has been overwritten by a subsequent run"): the gradients are outputs of the backward graph, and
    ``zero_grad(set_to_none=False)`` kept them as ``.grad`` into the next replay, which overwrote them while
    autograd accumulated into them. They are set to ``None`` after each step, the loss is never kept, and each step
    begins a new graph generation."""
    model = w.model().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=w.lr, weight_decay=w.weight_decay)
    fwd = torch.compile(model, dynamic=False, **_compile_kw("reduce-overhead" if graphs else True, dev, smoke_backend))
    opt_step = torch.compile(opt.step, dynamic=False, **_compile_kw(True, dev, smoke_backend))
    g = torch.Generator(device=dev).manual_seed(w.seed)
    x = torch.randn(batch, *w.shape, device=dev, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, w.num_classes, (batch,), device=dev, generator=g)

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)

    return step, model


def single_model_pass(w, dev: torch.device, steps: int, batch: int, graphs: bool, smoke_backend: str = "aot_eager",
                      warmup: int = 3) -> float:
    """Seconds for ``steps`` steps of :func:`single_model_step` (timed after ``warmup`` steps, which compile)."""
    step, _ = single_model_step(w, dev, batch, graphs, smoke_backend)
    return seconds(step, dev, steps, warmup)


def seconds(fn, dev: torch.device, reps: int, warmup: int = 1) -> float:
    """Wall seconds of ``reps`` calls of ``fn`` after ``warmup`` untimed ones, the device synchronised around."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(dev)
    return time.perf_counter() - t


def anchor(w, dev: str, smoke_backend: str = "aot_eager") -> dict[str, float]:
    """(a) and (b) of the module docstring; prints each as measured and keeps them in :data:`MEASURED`."""
    d = torch.device(dev)
    images = w.clients * w.steps * w.batch
    a = single_model_pass(w, d, w.steps, w.clients * w.batch, False, smoke_backend)
    MEASURED["anchor_a"] = a
    print(f"anchor: one model, {images} images as {w.steps} steps x batch {w.clients * w.batch} "
          f"(compiled, channels-last, bf16): (a) {a:.3f} s", flush=True)
    b = single_model_pass(w, d, w.clients * w.steps, w.batch, True, smoke_backend)
    MEASURED["anchor_b"] = b
    print(f"anchor: one model, {images} images as {w.clients * w.steps} steps x batch {w.batch} "
          f"(compiled{' with CUDA graphs' if d.type == 'cuda' else ''}): (b) {b:.3f} s = {b / a:.2f} x (a)", flush=True)
    return {"anchor_a": a, "anchor_b": b}


def route_row(name: str, w, dev: str, rounds: int = 3, smoke_backend: str = "aot_eager") -> dict[str, Any]:
    """One route's FedAvg rounds (see the module docstring); ``x0``: the model after round 0, for the comparison."""
    from fedlight.lab.benchmarks.gpu import H100_BF16_PEAK, flop_per_sample
    from fedlight.lab.benchmarks.route_candidates import swap
    from fedlight.lab.benchmarks.workload import fedlight_loop

    d = torch.device(dev)
    kw = dict(ROUTES[name])
    candidate = kw.pop("candidate", None)
    if d.type != "cuda" and kw["compile"]:
        kw["compile"] = smoke_backend
    model = w.model().to(d)
    fps = flop_per_sample(model, w.shape, w.num_classes, d)
    if d.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    loop = fedlight_loop(model, w.data(), w, dev, "bf16-mixed", "fedavg", **kw)
    if candidate is not None:
        swap(loop, candidate, bmm_from=None if d.type == "cuda" else 1)  # on CPU (smoke) every conv takes the bmm
    _sync(d)
    t = time.perf_counter()
    loop.run_round(0)
    _sync(d)
    first = time.perf_counter() - t
    x0 = torch.cat([v.detach().float().flatten() for v in loop.x.values()])
    times = []
    for r in range(1, 1 + rounds):
        t = time.perf_counter()
        loop.run_round(r)
        _sync(d)
        times.append(time.perf_counter() - t)
    s = statistics.median(times)
    flops = w.clients * w.steps * w.batch * fps
    row = {"route": name, "runner": getattr(loop.runner, "description", loop.runner.name), "s_per_round": s,
           "first_round_s": first, "tflops": flops / s / 1e12, "mfu_bf16": flops / s / H100_BF16_PEAK,
           "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if d.type == "cuda" else 0.0,
           "fallbacks": len(getattr(loop.runner, "fallbacks", [])), "x0": x0, "loop": loop}
    if "anchor_a" in MEASURED:
        row["x_anchor_a"] = s / MEASURED["anchor_a"]
    return row


def routes(w, dev: str, names: list[str], rounds: int = 3, smoke_backend: str = "aot_eager",
           profile: bool = True) -> list[dict[str, Any]]:
    """Every route of ``names``, one line each as measured (a failing route prints its error and the rest go on),
    then the table of them all (:func:`table`) and, with ``profile``, one profiled round of the fastest."""
    rows, ref, best = [], None, None
    for name in names:
        try:
            row = route_row(name, w, dev, rounds, smoke_backend)
        except Exception as e:  # noqa: BLE001 - one failing route must not hide the others' numbers
            print(f"routes: {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            continue
        x0, loop = row.pop("x0"), row.pop("loop")
        ref = x0 if ref is None else ref
        row["max_dx0_vs_first"] = float((x0 - ref).abs().max())
        rows.append(row)
        if best is None or row["s_per_round"] < best[0]["s_per_round"]:
            best = (row, loop)
        del loop
        print("routes: " + line(row), flush=True)
    print(table(rows), flush=True)
    if profile and best is not None:
        profile_round(best[1], best[0]["route"], w.steps, rounds + 1)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The routes as the markdown table of ``results/performance.md`` §6 (ratio to anchor (a), MFU)."""
    a = MEASURED.get("anchor_a")
    head = (f"| route | runner | s/round | x (a) | MFU | first round s |\n|---|---|---|---|---|---|\n"
            f"| anchor (a) | one model | {a:.3f} | 1.00 | | |\n" if a else
            "| route | runner | s/round | x (a) | MFU | first round s |\n|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['route']} | {r['runner']} | {r['s_per_round']:.3f} | "
        f"{r['x_anchor_a']:.2f} | {100 * r['mfu_bf16']:.1f} % | {r['first_round_s']:.1f} |" if "x_anchor_a" in r else
        f"| {r['route']} | {r['runner']} | {r['s_per_round']:.3f} | - | {100 * r['mfu_bf16']:.1f} % | "
        f"{r['first_round_s']:.1f} |" for r in sorted(rows, key=lambda r: r["s_per_round"]))


def profile_round(loop, name: str, steps: int, r: int, top: int = 8):
    """One profiled round of ``loop``: prints wall, the summed kernel time and its share, the costliest kernels;
    returns the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from fedlight.lab.benchmarks.gpu import kernel_seconds

    dev = loop.device
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    _sync(dev)
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        loop.run_round(r)
        _sync(dev)
    wall = time.perf_counter() - t
    busy, kernels = kernel_seconds(prof)
    print(f"profile: {name}: wall {wall:.3f} s, GPU kernel time {busy:.3f} s ({100 * busy / wall:.0f} % busy), "
          f"{len(kernels) / steps:.0f} kernels per step", flush=True)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e6
    for k, sec in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"profile:   {100 * sec / max(busy, 1e-12):5.1f} %  {sec:.3f} s  {k[:110]}", flush=True)
    return prof


def line(r: dict[str, Any]) -> str:
    anchor_ratio = f"{r['x_anchor_a']:.2f} x (a)" if "x_anchor_a" in r else "(a) not measured"
    return (f"{r['route']} [{r['runner']}]: {r['s_per_round']:.3f} s/round, {anchor_ratio}, first round "
            f"{r['first_round_s']:.1f} s, {r['tflops']:.1f} TFLOP/s, MFU {100 * r['mfu_bf16']:.1f} %, peak "
            f"{r['peak_gb']:.2f} GB, fallbacks {r['fallbacks']}, max |dx| after round 0 vs first route "
            f"{r['max_dx0_vs_first']:.2e}")
