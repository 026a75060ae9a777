#!/usr/bin/env python
"""Where a stacked ResNet-18 round spends its time on a GPU, and what the next routes would buy (issue 19).

    python tools/gpu_profile.py                 # on a CUDA machine, after tools/gpu_check.sh
    python tools/gpu_profile.py --smoke         # CPU, tiny: checks the script runs (numbers meaningless)

Sections, each printed as soon as it is measured (a timeout keeps what came before):

1. ``round``: FedAvg's compiled stacked round (10 clients x 50 steps x batch 50, ResNet-18 GroupNorm, bf16),
   one profiled round: wall seconds, GPU kernel seconds (the sum of kernel durations, nothing else), kernels per
   stacked step, the ten costliest kernels and CPU ops; then the same round with ``cudnn.benchmark`` on.
2. ``conv``: one stacked 3x3 convolution per ResNet-18 stage, forward + backward, C clients: the grouped
   convolution vmap produces (``cudnn.benchmark`` off / on), and the same as one batched matmul over unfolded
   patches. Milliseconds per call and the ratio to the grouped convolution.
3. ``wgrad``: the grouped convolution with its weight gradient computed as one batched matmul (the cuDNN
   grouped weight-gradient kernel is the costliest kernel of the round), against cuDNN, with the error.
4. ``graphs``: the round compiled with ``mode="reduce-overhead"`` (CUDA graphs), s/round.
5. ``procs``: several processes share the GPU, each training its share of the 10 clients as one compiled stacked
   chunk, all at once after a barrier: the round-equivalent seconds (slowest process) for 1, 2 and 4 processes.
6. ``anchor`` (issue 31): the round's 25,000 images through one ResNet-18 (GroupNorm, bf16, compiled,
   channels-last): (a) 50 steps at batch 500, (b) 500 steps at batch 50 with CUDA graphs
   (:mod:`fedlight.lab.benchmarks.routes`). Later sections print the round as a ratio to (a).
7. ``routes`` (issues 31, 42): FedAvg rounds under each client route (``--routes``; default
   ``fedlight.lab.benchmarks.routes.FIRST_CALL``, any of ``ROUTES``): s/round, ratio to (a), first round, MFU, peak
   memory, fallbacks, and the model after round 0 against the first route's; then the table of them all and one
   profiled round of the fastest (its costliest kernels).

The route comparison of a GPU session: ``python tools/gpu_profile.py --sections anchor,routes`` (about 5 minutes on
an H100, mostly compilation). ``--smoke`` runs the anchor and routes sections on LeNet-5 with the ``aot_eager``
backend (the ResNet-18 sections keep ResNet-18 at tiny sizes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedlight.lab.benchmarks.routes import FIRST_CALL, MEASURED, ROUTES, anchor, routes, seconds  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _loop(w, dev: str, compile):
    from fedlight.lab.benchmarks.workload import fedlight_loop

    model = w.model().to(dev)
    if dev == "cpu" and compile:  # --smoke: the same dynamo/AOTAutograd path, without inductor's C++ build
        compile = "aot_eager"
    return fedlight_loop(model, w.data(), w, dev, "bf16-mixed", "fedavg", parallelism="vmap", compile=compile)


def _rounds(loop, first: int, n: int) -> float:
    dev = loop.device
    times = []
    for r in range(first, first + n):
        _sync(dev)
        t = time.perf_counter()
        loop.run_round(r)
        _sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _profiled(loop, r: int, steps: int, top: int = 10) -> None:
    from fedlight.lab.benchmarks.routes import profile_round

    prof = profile_round(loop, "stacked step", steps, r, top)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
    print(table, flush=True)


def round_section(w, dev: str) -> None:
    loop = _loop(w, dev, True)
    t = time.perf_counter()
    loop.run_round(0)
    print(f"round: compiled stacked, first round {time.perf_counter() - t:.1f} s", flush=True)
    s = _rounds(loop, 1, 3)
    a = MEASURED.get("anchor_a")
    print(f"round: compiled stacked, s/round {s:.3f} (median of 3)" + (f" = {s / a:.2f} x anchor (a)" if a else ""),
          flush=True)
    _profiled(loop, 4, w.steps)
    torch.backends.cudnn.benchmark = True
    loop.run_round(5)
    print(f"round: compiled stacked + cudnn.benchmark, s/round {_rounds(loop, 6, 3):.3f} (median of 3)", flush=True)
    _profiled(loop, 9, w.steps, top=6)
    torch.backends.cudnn.benchmark = False


def _ms(fn, dev: torch.device, reps: int) -> float:
    return seconds(fn, dev, reps) / reps * 1e3


def conv_section(C: int, B: int, dev: str, reps: int, sizes) -> None:
    d = torch.device(dev)
    dt = torch.bfloat16 if d.type == "cuda" else torch.float32
    for ch, hw in sizes:
        x = torch.randn(C, B, ch, hw, hw, device=d, dtype=dt, requires_grad=True)
        wt = torch.randn(C, ch, ch, 3, 3, device=d, dtype=dt, requires_grad=True)

        def grouped():
            xg = x.transpose(0, 1).reshape(B, C * ch, hw, hw)
            y = F.conv2d(xg, wt.reshape(C * ch, ch, 3, 3), padding=1, groups=C)
            y.float().square().mean().backward()

        def bmm():
            cols = F.unfold(x.reshape(C * B, ch, hw, hw), 3, padding=1)  # [C*B, ch*9, L]
            cols = cols.view(C, B, ch * 9, hw * hw).transpose(1, 2).reshape(C, ch * 9, B * hw * hw)
            y = torch.bmm(wt.reshape(C, ch, ch * 9), cols)  # [C, ch, B*L]
            y.float().square().mean().backward()

        row = []
        for name, fn, bench in (("grouped", grouped, False), ("grouped+benchmark", grouped, True), ("bmm", bmm, False)):
            torch.backends.cudnn.benchmark = bench
            row.append((name, _ms(fn, d, reps)))
        torch.backends.cudnn.benchmark = False
        base = row[0][1]
        print(f"conv: C={C} B={B} {ch}ch {hw}x{hw}: " + ", ".join(f"{n} {ms:.2f} ms (x{ms / base:.2f})"
                                                                  for n, ms in row), flush=True)


class _WgradBmm(torch.autograd.Function):
    """A grouped 3x3 convolution whose weight gradient is one batched matmul over unfolded patches."""

    @staticmethod
    def forward(ctx, xg, w, C):
        ctx.save_for_backward(xg, w)
        ctx.C = C
        return F.conv2d(xg, w, padding=1, groups=C)

    @staticmethod
    def backward(ctx, gy):
        xg, w = ctx.saved_tensors
        C = ctx.C
        B, _, H, W = xg.shape
        n_out, n_in = w.shape[0], w.shape[1]
        out, L = n_out // C, H * W
        gx = torch.nn.grad.conv2d_input(xg.shape, w, gy, padding=1, groups=C)
        cols = F.unfold(xg, 3, padding=1).view(B, C, n_in * 9, L).permute(1, 0, 3, 2).reshape(C, B * L, n_in * 9)
        g = gy.reshape(B, C, out, L).permute(1, 2, 0, 3).reshape(C, out, B * L)
        return gx, torch.bmm(g, cols).view(n_out, n_in, 3, 3), None


class _WgradTriton(_WgradBmm):
    """The same, the weight gradient from :func:`fedlight.lab.benchmarks.triton_wgrad.grouped_wgrad` (issue 42)."""

    @staticmethod
    def backward(ctx, gy):
        from fedlight.lab.benchmarks.triton_wgrad import grouped_wgrad

        xg, w = ctx.saved_tensors
        gx = torch.nn.grad.conv2d_input(xg.shape, w, gy, padding=1, groups=ctx.C)
        return gx, grouped_wgrad(xg, gy.contiguous(), ctx.C).to(w.dtype), None


def wgrad_section(C: int, B: int, dev: str, reps: int, sizes) -> None:
    d = torch.device(dev)
    dt = torch.bfloat16 if d.type == "cuda" else torch.float32
    for ch, hw in sizes:
        xg = torch.randn(B, C * ch, hw, hw, device=d, dtype=dt, requires_grad=True)
        w = torch.randn(C * ch, ch, 3, 3, device=d, dtype=dt, requires_grad=True)
        ref = F.conv2d(xg, w, padding=1, groups=C)
        ref.float().square().mean().backward()
        gw, gx = w.grad.clone(), xg.grad.clone()
        xg.grad = w.grad = None
        _WgradBmm.apply(xg, w, C).float().square().mean().backward()
        err = ((w.grad.float() - gw.float()).norm() / gw.float().norm()).item()
        errx = ((xg.grad.float() - gx.float()).norm() / gx.float().norm()).item()
        cudnn = _ms(lambda: F.conv2d(xg, w, padding=1, groups=C).float().square().mean().backward(), d, reps)
        mine = _ms(lambda: _WgradBmm.apply(xg, w, C).float().square().mean().backward(), d, reps)
        print(f"wgrad: C={C} B={B} {ch}ch {hw}x{hw}: cudnn grouped {cudnn:.2f} ms, wgrad-as-bmm {mine:.2f} ms "
              f"(x{mine / cudnn:.2f}); rel. error dW {err:.1e}, dX {errx:.1e}", flush=True)
        if d.type != "cuda":
            print("wgrad: triton: needs CUDA (checked on CPU by tests/loop/test_route_candidates.py)", flush=True)
            continue
        xg.grad = w.grad = None
        _WgradTriton.apply(xg, w, C).float().square().mean().backward()
        err = ((w.grad.float() - gw.float()).norm() / gw.float().norm()).item()
        tri = _ms(lambda: _WgradTriton.apply(xg, w, C).float().square().mean().backward(), d, reps)
        print(f"wgrad: C={C} B={B} {ch}ch {hw}x{hw}: cudnn grouped {cudnn:.2f} ms, wgrad in Triton {tri:.2f} ms "
              f"(x{tri / cudnn:.2f}); rel. error dW {err:.1e}", flush=True)


def graphs_section(w, dev: str) -> None:
    loop = _loop(w, dev, "reduce-overhead")
    t = time.perf_counter()
    loop.run_round(0)
    print(f"graphs: reduce-overhead, first round {time.perf_counter() - t:.1f} s; runner {loop.runner.description}",
          flush=True)
    print(f"graphs: reduce-overhead, s/round {_rounds(loop, 1, 3):.3f} (median of 3)", flush=True)


def _proc_worker(rank: int, procs: int, shape: tuple[int, int, int], dev: str, compile, barrier, out) -> None:
    from fedlight.lab.benchmarks.workload import Workload

    clients, steps, batch = shape
    share = clients // procs + (rank < clients % procs)  # 10 clients over 4 processes: 3, 3, 2, 2
    w = Workload("resnet18", clients=share, steps=steps, batch=batch, seed=rank)
    loop = _loop(w, dev, compile)
    loop.run_round(0)  # compiles
    _sync(loop.device)
    barrier.wait()
    t = time.perf_counter()
    for r in range(1, 4):
        loop.run_round(r)
    _sync(loop.device)
    out.put((rank, (time.perf_counter() - t) / 3))


def procs_section(w, dev: str, counts: tuple[int, ...], compile) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for n in counts:
        barrier, out = ctx.Barrier(n), ctx.Queue()
        ps = [ctx.Process(target=_proc_worker, args=(i, n, (w.clients, w.steps, w.batch), dev, compile, barrier, out))
              for i in range(n)]
        for p in ps:
            p.start()
        times = sorted(out.get(timeout=600)[1] for _ in ps)
        for p in ps:
            p.join()
        print(f"procs: {w.clients} clients over {n} process(es): round-equivalent {times[-1]:.3f} s "
              f"(per process {', '.join(f'{t:.3f}' for t in times)})", flush=True)


def main(argv: list[str] | None = None) -> int:
    from fedlight.lab.benchmarks.workload import Workload

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: checks the script, numbers meaningless")
    p.add_argument("--sections", default="round,conv,graphs")
    p.add_argument("--procs", default="1,2,4", help="procs section: process counts to try")
    p.add_argument("--routes", default=",".join(FIRST_CALL),
                   help=f"routes section: routes to compare, in this order (of {', '.join(ROUTES)})")
    p.add_argument("--rounds", type=int, default=3, help="routes section: timed rounds per route")
    a = p.parse_args(argv)
    dev = "cpu" if a.smoke else "cuda"
    w = Workload("resnet18", clients=2 if a.smoke else 10, steps=2 if a.smoke else 50, batch=4 if a.smoke else 50)
    sizes = ((8, 8),) if a.smoke else ((64, 32), (128, 16), (256, 8), (512, 4))
    small = Workload("lenet5", clients=2, steps=2, batch=4)
    for s in a.sections.split(","):
        t = time.perf_counter()
        if s == "round":
            round_section(w, dev)
        elif s == "conv":
            conv_section(w.clients, w.batch, dev, 2 if a.smoke else 20, sizes)
        elif s == "wgrad":
            wgrad_section(w.clients, w.batch, dev, 2 if a.smoke else 20, sizes)
        elif s == "graphs":
            graphs_section(w, dev)
        elif s == "procs":
            procs_section(w, dev, tuple(int(n) for n in a.procs.split(",")), False if a.smoke else True)
        elif s == "anchor":
            anchor(small if a.smoke else w, dev)
        elif s == "routes":
            routes(small if a.smoke else w, dev, a.routes.split(","), 1 if a.smoke else a.rounds)
        else:
            p.error(f"unknown section {s!r}")
        print(f"[{s}: {time.perf_counter() - t:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
