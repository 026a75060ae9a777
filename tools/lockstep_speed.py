"""Lockstep against one run after another, in one process and one clock (issue 57's CPU speed ratio).

Arms, interleaved per repetition (the order rotates, so a load that drifts on a shared machine falls on each arm):
``lockstep``: the seeds as one ``fedlight lockstep`` group (stacked runner); ``one by one``: the same runs one after
another with the same runner; ``one by one, default runner``: the runs as ``fedlight fit`` trains them by default on
this device (on CPU the sequential runner). Every run is a whole ``fedlight fit`` (data set-up, rounds, evaluation,
checkpoints) in a fresh folder, after one untimed round of each arm (imports, caches). Prints each arm's wall and
CPU seconds per repetition, the medians and the ratios.

    python tools/lockstep_speed.py                       # 3 seeds of the Fashion-MNIST MLP recipe, 3 rounds, 3 reps
    python tools/lockstep_speed.py --smoke               # tiny.yaml, 2 rounds, 1 rep (the suite runs this)
    python tools/lockstep_speed.py --parts               # why: a stacked step of 30 clients vs 3 x 10, and
                                                         # 3 models evaluated in one vmap vs one by one (CPU time)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _flags(config: str, rounds: int, runner: str | None) -> list[str]:
    return ["--config", config, "--loop.rounds", str(rounds), "--loggers", "null", "--loop.progress", "false",
            *(["--loop.client_parallelism", runner] if runner else [])]


def arms(config: str, rounds: int, seeds: list[int], out: Path) -> dict[str, callable]:
    from fedlight.config.cli import main

    def lockstep():
        d = out / f"l{time.monotonic_ns()}"
        assert main(["lockstep", *_flags(config, rounds, "vmap"), "--out_dir", str(d),
                     "--seeds", ",".join(map(str, seeds))]) == 0

    def one_by_one(runner):
        def go():
            d = out / f"s{time.monotonic_ns()}"
            for k in seeds:
                assert main(["fit", *_flags(config, rounds, runner), "--seed", str(k), "--out_dir",
                             str(d / f"seed{k}")]) == 0
        return go

    return {"lockstep": lockstep, "one by one": one_by_one("vmap"), "one by one, default runner": one_by_one(None)}


def measure(config: str, rounds: int, seeds: list[int], reps: int) -> tuple[dict, dict]:
    """Per arm, the wall and the CPU seconds (``time.process_time``: not the time descheduled) of each repetition."""
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        todo = arms(config, rounds, seeds, Path(tmp))
        names = list(todo)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for name in names:  # imports, data caches, first-call costs: not measured
                arms(config, 1, seeds, Path(tmp))[name]()
        for rep in range(reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:  # rotate the order
                quiet = io.StringIO()
                with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                    t, c = time.perf_counter(), time.process_time()
                    todo[name]()
                    times.setdefault(name, []).append(time.perf_counter() - t)
                    cpu.setdefault(name, []).append(time.process_time() - c)
                print(f"rep {rep + 1} {name}: {times[name][-1]:.2f} s wall, {cpu[name][-1]:.2f} s CPU", flush=True)
    return times, cpu


def parts(reps: int = 15) -> None:
    """The two places a group stacks more than a run alone, timed in CPU seconds (medians of interleaved reps): ten
    SGD steps of 30 Fashion-MNIST MLP clients (784-200-200-10, batch 50) stacked as 3 x 10 or 1 x 30, and three
    such models evaluated on 10 x 1000 images one by one or in one vmap."""
    import torch
    from torch.func import functional_call, vmap

    from fedlight.models import MLP

    def model():
        return MLP(in_features=784, hidden=[200, 200], num_classes=10)

    m = model()

    def stacked_step(c: int):
        p = {k: v.detach().expand(c, *v.shape).clone().requires_grad_(True) for k, v in m.named_parameters()}
        x, y = torch.randn(c, 50, 784), torch.randint(0, 10, (c, 50))
        opt = torch.optim.SGD(list(p.values()), lr=0.1, weight_decay=1e-3)
        loss = vmap(lambda q, xb, yb: torch.nn.functional.cross_entropy(functional_call(m, q, (xb,)), yb))

        def go():
            opt.zero_grad()
            loss(p, x, y).sum().backward()
            opt.step()
        return go

    s10, s30 = stacked_step(10), stacked_step(30)
    x, ms = torch.randn(1000, 784), [model().eval() for _ in range(3)]
    stack = {k: torch.stack([dict(mm.named_parameters())[k].detach() for mm in ms]) for k, _ in m.named_parameters()}
    arms = {"3 x 10 stacked": lambda: [s10() for _ in range(3)], "1 x 30 stacked": s30,
            "eval one by one": lambda: [mm(x) for mm in ms],
            "eval in one vmap": lambda: vmap(lambda q: functional_call(m, q, (x,)))(stack)}
    cpu: dict[str, list[float]] = {k: [] for k in arms}
    for rep in range(reps):
        for name in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
            grad = torch.enable_grad() if "stacked" in name else torch.no_grad()
            with grad:
                c = time.process_time()
                for _ in range(10):
                    arms[name]()
                cpu[name].append(time.process_time() - c)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    for k, v in med.items():
        print(f"  {k}: {v:.3f} s CPU (median of {reps})")
    print(f"1 x 30 / 3 x 10: {med['1 x 30 stacked'] / med['3 x 10 stacked']:.3f}; "
          f"one vmap / one by one: {med['eval in one vmap'] / med['eval one by one']:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "recipes" / "fedavg_mlp_fmnist_dir0.1.yaml"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tests/configs/tiny.yaml, 2 rounds, 2 seeds, 1 repetition")
    p.add_argument("--parts", action="store_true", help="only the stacked step and evaluation, 30 vs 3 x 10")
    a = p.parse_args(argv)
    if a.parts:
        import torch

        torch.set_num_threads(1)
        parts(3 if a.smoke else 15)
        return 0
    if a.smoke:
        a.config, a.rounds, a.seeds, a.reps = str(ROOT / "tests" / "configs" / "tiny.yaml"), 2, 2, 1
    import torch

    torch.set_num_threads(1)
    times, cpu = measure(a.config, a.rounds, list(range(a.seeds)), a.reps)
    print(f"{a.seeds} seeds x {a.rounds} rounds of {Path(a.config).name}, {a.reps} repetitions, 1 thread, load "
          f"average {os.getloadavg()[0]:.1f}; medians, wall / CPU:")
    for name, label in (("wall", times), ("CPU", cpu)):
        med = {k: statistics.median(v) for k, v in label.items()}
        if name == "wall":
            for k in med:
                print(f"  {k}: {med[k]:.2f} s wall, {statistics.median(cpu[k]):.2f} s CPU")
        print(f"ratio one by one / lockstep (same stacked runner), {name}: {med['one by one'] / med['lockstep']:.3f}")
        print(f"ratio one by one with the default runner / lockstep, {name}: "
              f"{med['one by one, default runner'] / med['lockstep']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
