#!/usr/bin/env python
"""The device benchmark of issue 57: what stacking runs buys for FedNSAM Table 2's LeNet-5 CIFAR-10 column, on
synthetic data (nothing to upload), in at most about 120 s of a GPU window.

Sections (every figure measured in the same call; the unit of work is a *client step*: one batch of 50 CIFAR images
through LeNet-5, forward + backward + SGD update, 80.6 MFLOP an image):

1. ``conv``: LeNet-5's conv1 (3→64) and conv2 (64→64), 5×5, stacked over 10/30/110/330 models as one grouped
   convolution (what ``vmap`` makes of a convolution with per-model weights), forward + backward in bf16, NCHW and
   channels-last: ms and TFLOP/s (conv1 needs no input gradient: 2× its forward; conv2 3×); and conv1 as unfold +
   one batched matmul per model (``im2col+bmm``), the candidate for its slow grouped form.
2. ``step``: one stacked step of 330 clients (the column's 33 runs × 10 clients) eager (``vmap`` of
   ``functional_call``), graphed (the whole step, forward + backward + update, captured once in a CUDA graph over
   static parameter, batch and gradient buffers, the lr a device tensor) and compiled (``torch.compile`` of the
   stacked loss, the route ``loop.compile: true`` takes); each also with conv1 as one batched matmul (``+mm``,
   ``loop.matmul_convs: 3``, fedlight's own :func:`~fedlight.runners.matmul_conv.conv_as_matmul`). Default routes:
   eager, eager+mm, compiled, compiled+mm (graphed gained 6 % over eager in the first window).
3. ``unions``: a ``--lockstep column`` process's 11 unions (rows of different local rules) of 30 clients each, trained
   one after another and interleaved on CUDA streams (``fedlight lockstep --streams``), eager and compiled; with
   ``graphs`` (compiled with CUDA graphs, auto's route, which fedlight never interleaves) one after another only.
   ``profile`` (only when asked, ``--sections profile``): 3 steps of each eager or compiled route under
   ``torch.profiler``: wall and kernel milliseconds a step, the costliest kernels.
4. ``pool``: today's route, 16 processes side by side each training clients one after another, without and (when
   the machine has it) with MPS: a daemon started in a temporary folder for this call and stopped at its end; no
   device setting is changed.

The last lines are the ratios of every route's client steps per second to the pool without MPS. ``--smoke`` runs all
of it on the CPU at a tiny size (tests/test_gpu_lockstep_bench.py): there the "graph" is the step called directly
on its static buffers, the compiled route and MPS are skipped with one line each.

    python tools/gpu_lockstep_bench.py [--smoke] [--sections conv,step,unions,pool] [--routes ...] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedlight.models import LeNet5  # noqa: E402
from fedlight.runners import matmul_conv  # noqa: E402

SECTIONS = ("conv", "step", "profile", "unions", "pool")

COMPILED = {"compiled": True, "graphs": "reduce-overhead"}
"""The compiled routes: ``torch.compile`` of the stacked loss without CUDA graphs (``loop.compile: true``) and with
them (``reduce-overhead``, the route ``auto`` takes on CUDA)."""

MFLOP_PER_IMAGE = 80.6
"""LeNet-5 (the seed papers' 64-channel one) on a 32×32 image, forward + backward (issue 57)."""


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int, warmup: int = 2) -> float:
    """Seconds per call of ``fn`` (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return (time.perf_counter() - t) / reps


# --------------------------------------------------------------------------------------------------- 1. conv
def conv_section(dev, models, batch, reps) -> list[dict]:
    rows = []
    for layer, (cin, side, input_grad) in {"conv1": (3, 32, False), "conv2": (64, 14, True)}.items():
        for M in models:
            for layout in ("nchw", "channels_last"):
                fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
                x = torch.randn(batch, M * cin, side, side, device=dev, dtype=torch.bfloat16).to(memory_format=fmt)
                w = torch.randn(M * 64, cin, 5, 5, device=dev, dtype=torch.bfloat16).to(memory_format=fmt)
                x.requires_grad_(input_grad)
                w.requires_grad_(True)
                gout = torch.randn(batch, M * 64, side - 4, side - 4, device=dev, dtype=torch.bfloat16)
                gout = gout.to(memory_format=fmt)

                def step(x=x, w=w, gout=gout, M=M):
                    F.conv2d(x, w, groups=M).backward(gout)

                s = timed(step, dev, reps)
                flop = 2 * batch * M * 64 * (side - 4) ** 2 * cin * 25 * (3 if input_grad else 2)
                rows.append({"layer": layer, "models": M, "layout": layout, "ms": s * 1e3, "tflops": flop / s / 1e12})
                print(f"conv  {layer} {M:>4} models {layout:<13} {s * 1e3:8.3f} ms  {flop / s / 1e12:8.2f} TFLOP/s")
    for M in models:  # conv1 another way: its patches unfolded once, then one batched matmul per model
        s, flop = im2col_conv1(dev, M, batch, reps)
        rows.append({"layer": "conv1", "models": M, "layout": "im2col_bmm", "ms": s * 1e3, "tflops": flop / s / 1e12})
        print(f"conv  conv1 {M:>4} models {'im2col+bmm':<13} {s * 1e3:8.3f} ms  {flop / s / 1e12:8.2f} TFLOP/s")
    return rows


def im2col_conv1(dev, M: int, batch: int, reps: int) -> tuple[float, float]:
    """Seconds of conv1 forward + weight gradient for ``M`` models as unfold + ``bmm`` (the stacked grouped
    convolution of 3 input channels ran at 10-16 TFLOP/s on an H200), and its FLOP (the convolution's, as above)."""
    x = torch.randn(M * batch, 3, 32, 32, device=dev, dtype=torch.bfloat16)
    w = torch.randn(M, 64, 75, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gout = torch.randn(M, 64, batch * 28 * 28, device=dev, dtype=torch.bfloat16)

    def step():
        conv1_bmm(x, w, M, batch).backward(gout)

    return timed(step, dev, reps), 2 * batch * M * 64 * 28 ** 2 * 3 * 25 * 2


def conv1_bmm(x: torch.Tensor, w: torch.Tensor, M: int, batch: int) -> torch.Tensor:
    """conv1 of ``M`` models: ``x`` [M·batch, 3, 32, 32] (model-major), ``w`` [M, 64, 75] → [M, 64, batch·784]."""
    cols = F.unfold(x, 5).view(M, batch, 75, 28 * 28).transpose(1, 2).reshape(M, 75, batch * 28 * 28)
    return torch.bmm(w, cols)


# --------------------------------------------------------------------------------------------------- 2. step
class StackedStep:
    """One SGD step of ``M`` stacked LeNet-5 clients on static buffers: ``params`` (leading client dimension),
    ``x``/``y`` (the batch, copied in), ``lr`` (a 0-dim device tensor, so a graph replays any lr)."""

    def __init__(self, M: int, batch: int, dev: torch.device, compiled: bool | str = False,
                 matmul: bool = False) -> None:
        torch.manual_seed(0)
        self.model, self.dev = LeNet5().to(dev), dev
        if matmul:  # loop.matmul_convs 3: conv1 as unfold + one batched matmul, fedlight's own function
            for m in [self.model.get_submodule(n) for n in matmul_conv.select(self.model, 3)]:
                m._conv_forward = matmul_conv.conv_as_matmul(m)
        self.params = {k: v.detach().unsqueeze(0).repeat(M, *[1] * v.dim()).requires_grad_(True)
                       for k, v in self.model.named_parameters()}
        self.x = torch.randn(M, batch, 3, 32, 32, device=dev)
        self.y = torch.randint(0, 10, (M, batch), device=dev)
        self.lr = torch.tensor(0.01, device=dev)
        self.loss = torch.zeros(M, device=dev)
        losses = vmap(self._one)
        mode = {"mode": compiled} if isinstance(compiled, str) else {}  # "reduce-overhead": auto's CUDA route
        self.losses = torch.compile(losses, dynamic=False, **mode) if compiled else losses

    def _one(self, p, x, y):
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, cache_enabled=False):  # capturable
            return F.cross_entropy(functional_call(self.model, p, (x,)), y)

    def __call__(self) -> None:
        ps = list(self.params.values())
        losses = self.losses(self.params, self.x, self.y)
        grads = torch.autograd.grad(losses.sum(), ps)
        with torch.no_grad():
            torch._foreach_add_(ps, torch._foreach_mul(grads, -self.lr))  # the lr tensor, read at replay
            self.loss.copy_(losses.detach())


def graphed(step: StackedStep):
    """The step captured in a CUDA graph (replayed per call); on a CPU the step itself, on the same buffers."""
    if step.dev.type != "cuda":
        return step
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up on a side stream, as capture requires
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


def step_section(dev, M, batch, reps, compile_ok, routes=("eager", "graphed", "compiled")) -> dict[str, float]:
    out = {}
    for route in routes:
        base = route.removesuffix("+mm")
        if base in COMPILED and not compile_ok:
            print(f"step  {route}: skipped (--smoke on a CPU: no inductor compile in the suite)")
            continue
        try:
            step = StackedStep(M, batch, dev, compiled=COMPILED.get(base, False), matmul=route.endswith("+mm"))
            s = timed(graphed(step) if base == "graphed" else step, dev, reps)
        except Exception as e:  # noqa: BLE001 - one route failing says so and the bench goes on
            print(f"step  {route}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            continue
        out[route] = M / s
        print(f"step  {route:<8} {M} clients x batch {batch}: {s * 1e3:8.2f} ms, {M / s:9.1f} client steps/s, "
              f"{M * batch * MFLOP_PER_IMAGE * 1e6 / s / 1e12:7.2f} TFLOP/s")
    return out


# ------------------------------------------------------------------------------------------------ 2c. profile
def profile_section(dev, M: int, batch: int, routes: list[str], compile_ok: bool, steps: int = 3,
                    top: int = 12) -> dict[str, dict]:
    """Where a stacked step's time goes: ``steps`` steps of each route under ``torch.profiler``; per step the wall
    milliseconds, the kernels' milliseconds (the sum of their durations: the device's busy time, overlaps counted
    twice) and the ``top`` costliest kernels (CPU ops on a CPU). Not the graphed routes: their kernels hide inside
    the graph launch."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    out = {}
    for route in routes:
        base = route.removesuffix("+mm")
        if base not in ("eager", "compiled"):
            continue
        if base == "compiled" and not compile_ok:
            print(f"profile {route}: skipped (--smoke on a CPU: no inductor compile in the suite)")
            continue
        try:
            step = StackedStep(M, batch, dev, compiled=COMPILED.get(base, False), matmul=route.endswith("+mm"))
            for _ in range(3):
                step()
            sync(dev)
            with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
                t = time.perf_counter()
                for _ in range(steps):
                    step()
                sync(dev)
                wall = (time.perf_counter() - t) / steps
        except Exception as e:  # noqa: BLE001 - one route failing says so and the bench goes on
            print(f"profile {route}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            continue
        events = prof.key_averages()
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        busy = sum(getattr(e, key) for e in events if not cuda or e.device_type == torch.autograd.DeviceType.CUDA)
        busy = busy / steps / 1e3  # us -> ms per step
        costly = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
        out[route] = {"wall_ms": wall * 1e3, "busy_ms": busy,
                      "top": [(e.key[:90], getattr(e, key) / steps / 1e3) for e in costly]}
        print(f"profile {route:<11} {M} clients: {wall * 1e3:8.2f} ms a step, {'kernels' if cuda else 'CPU ops'} "
              f"{busy:8.2f} ms ({busy / (wall * 1e3):.0%} of the wall)")
        for name, ms in out[route]["top"]:
            print(f"profile {route:<11}   {ms:8.3f} ms  {name}")
    return out


# ------------------------------------------------------------------------------------------------- 2b. unions
def unions_section(dev, unions: int, runs: int, clients: int, batch: int, steps: int, reps: int,
                   routes: tuple[str, ...], compile_ok: bool) -> dict[str, float]:
    """A ``--lockstep column`` process: ``unions`` unions (rows with different local rules) of ``runs`` × ``clients``
    stacked clients each, ``steps`` local steps, trained one union after another, and interleaved step by step with
    each union on its own CUDA stream (:func:`fedlight.runners.interleave.interleave`, what ``fedlight lockstep
    --streams`` runs, its generator-state switches included). Client steps/s and the ratio."""
    from fedlight.runners.interleave import Streams, interleave

    M, out = runs * clients, {}
    pool = Streams(dev)
    for route in routes:
        if route not in ("eager", *COMPILED):
            continue
        if route in COMPILED and not compile_ok:
            print(f"unions {route}: skipped (--smoke on a CPU: no inductor compile in the suite)")
            continue
        try:
            us = [StackedStep(M, batch, dev, compiled=COMPILED.get(route, False)) for _ in range(unions)]
            for u in us[1:]:
                u.losses = us[0].losses  # one compiled function for every union, as one process's runners share it

            def one_by_one():
                for u in us:
                    for _ in range(steps):
                        u()

            def paused(u):
                for _ in range(steps):
                    u()
                    yield

            def interleaved():
                interleave([paused(u) for u in us], pool.take(len(us)), dev)

            a = timed(one_by_one, dev, reps, warmup=1)
            # torch.compile's CUDA graphs share one memory pool in stream order: never interleaved (fedlight does not)
            b = timed(interleaved, dev, reps, warmup=1) if route != "graphs" else None
        except Exception as e:  # noqa: BLE001 - one route failing says so and the bench goes on
            print(f"unions {route}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            continue
        n = unions * M * steps
        out[f"unions {route}"] = n / a
        line = f"unions {route:<8} {unions} x {M} clients x {steps} steps: one after another {a * 1e3:8.1f} ms " \
               f"({n / a:9.1f} client steps/s)"
        if b is not None:
            out[f"unions {route} streams"] = n / b
            line += f"; interleaved on streams {b * 1e3:8.1f} ms ({n / b:9.1f}); ratio {a / b:5.2f}"
        print(line)
    return out


# --------------------------------------------------------------------------------------------------- 3. pool
def worker(seconds: float, batch: int) -> None:
    """One process of today's pool: one LeNet-5 client step after another for ``seconds``; prints steps/s."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = LeNet5().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 3, 32, 32, device=dev), torch.randint(0, 10, (batch,), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    timed(step, dev, 1)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        step()
        n += 1
    sync(dev)
    print(json.dumps({"steps_per_s": n / (time.perf_counter() - t)}))


def pool(procs: int, seconds: float, batch: int, env: dict | None = None) -> float:
    cmd = [sys.executable, __file__, "--worker", str(seconds), "--batch", str(batch)]
    ps = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
          for _ in range(procs)]
    outs = [p.communicate(timeout=seconds + 120)[0] for p in ps]
    if any(p.returncode for p in ps):
        raise RuntimeError(f"a pool process failed: {[p.returncode for p in ps]}")
    return sum(json.loads(o.strip().splitlines()[-1])["steps_per_s"] for o in outs)


def with_mps(fn):
    """``fn(env)`` under an MPS daemon of this call (a temporary pipe and log folder), stopped afterwards; ``None``
    (and one line) when the machine has no MPS."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None or not torch.cuda.is_available():
        print("pool  with MPS: not measured (no nvidia-cuda-mps-control on this machine)")
        return None
    tmp = tempfile.mkdtemp(prefix="mps-")
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": f"{tmp}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{tmp}/log"}
    os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"]), os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"])
    if subprocess.run([ctl, "-d"], env=env).returncode != 0:
        print("pool  with MPS: not measured (the MPS daemon did not start)")
        return None
    try:
        return fn(env)
    finally:
        subprocess.run([ctl], input="quit\n", text=True, env=env)
        shutil.rmtree(tmp, ignore_errors=True)


def pool_section(procs, seconds, batch) -> dict[str, float]:
    out = {"pool": pool(procs, seconds, batch)}
    print(f"pool  {procs} processes, no MPS: {out['pool']:9.1f} client steps/s")
    mps = with_mps(lambda env: pool(procs, seconds, batch, env))
    if mps is not None:
        out["pool+MPS"] = mps
        print(f"pool  {procs} processes, MPS:    {mps:9.1f} client steps/s")
    return out


# --------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (the test suite)")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--worker", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--sections", default="conv,step,unions,pool", help=f"which of {', '.join(SECTIONS)} to run "
                    "(default: all but profile)")
    ap.add_argument("--routes", default="eager,eager+mm,compiled,compiled+mm", help="the stacked step's routes to "
                    "time: eager, graphed (one whole-step CUDA graph), compiled, graphs (compiled with CUDA graphs, "
                    "auto's route), each with +mm for conv1 as one batched matmul (loop.matmul_convs 3); the unions "
                    "section takes eager, compiled and graphs (graphs one after another only)")
    a = ap.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, a.batch)
        return 0
    torch.set_num_threads(1) if a.smoke else None
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    big = dev.type == "cuda"
    if not big and not a.smoke:
        print("no CUDA device: run with --smoke, or on a GPU")
        return 2
    batch = a.batch if big else 4
    t0 = time.perf_counter()
    print(f"device: {torch.cuda.get_device_name(dev) if big else 'cpu (smoke)'}; torch {torch.__version__}")
    sections, routes = set(a.sections.split(",")), a.routes.split(",")
    unknown = sections - set(SECTIONS)
    if unknown:
        print(f"unknown --sections {sorted(unknown)}: any of {', '.join(SECTIONS)}")
        return 2
    res: dict = {"routes": {}}
    if "conv" in sections:
        res["conv"] = conv_section(dev, (10, 30, 110, 330) if big else (2, 3), batch, 20 if big else 1)
    if "step" in sections:
        res["routes"] = step_section(dev, 330 if big else 3, batch, 10 if big else 1, compile_ok=big, routes=routes)
    if "profile" in sections:
        res["profile"] = profile_section(dev, 330 if big else 3, batch, routes, compile_ok=big)
    if "unions" in sections:
        res["routes"].update(unions_section(dev, 11 if big else 3, 3, 10 if big else 1, batch, 5 if big else 2,
                                            3 if big else 1, tuple(routes), compile_ok=big))
    if "pool" in sections:
        res["routes"].update(pool_section(16 if big else 2, 8.0 if big else 0.5, batch))
    base, what = (res["routes"]["pool"], "today's pool without MPS") if "pool" in res["routes"] else \
        next(((v, k) for k, v in res["routes"].items()), (None, None))
    for route, v in res["routes"].items():
        print(f"ratio {route:<9} {v / base:7.2f} x {what} ({v:.1f} client steps/s)")
    print(f"bench: {time.perf_counter() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
