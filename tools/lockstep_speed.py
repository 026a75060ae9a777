"""Lockstep against one run after another, in one process and one clock (issue 57's CPU speed ratio).

Arms, interleaved per repetition (the order rotates, so a load that drifts on a shared machine falls on each arm):
``lockstep``: the seeds as one ``fedlight lockstep`` group (stacked runner); ``one by one``: the same runs one after
another with the same runner; ``one by one, default runner``: the runs as ``fedlight fit`` trains them by default on
this device (on CPU the sequential runner). Every run is a whole ``fedlight fit`` (data set-up, rounds, evaluation,
checkpoints) in a fresh folder, after one untimed round of each arm (imports, caches). Prints each arm's wall and
CPU seconds per repetition, the medians and the ratios.

    python tools/lockstep_speed.py                       # 3 seeds of the Fashion-MNIST MLP recipe, 3 rounds, 3 reps
    python tools/lockstep_speed.py --smoke               # tiny.yaml, 2 rounds, 1 rep (the suite runs this)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "recipes" / "fedavg_mlp_fmnist_dir0.1.yaml"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tests/configs/tiny.yaml, 2 rounds, 2 seeds, 1 repetition")
    a = p.parse_args(argv)
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
