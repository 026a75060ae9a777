"""Seconds per round of every rule relative to FedAvg, interleaved in one process (cleaner than separate runs).

Workload: the Fashion-MNIST recipe's shapes (MLP 784-200-200-10, batch 50) on random tensors, 10 clients ×
``--steps`` local steps per round, SGD lr 0.1, wd 1e-3, clip 10, 32-true on CPU. For each repetition every rule runs
one round in turn; the table shows median s/round and the median of per-repetition ratios to FedAvg.
Usage: OMP_NUM_THREADS=1 python tools/rule_timing.py --reps 5 --steps 20 --out results/rule_timing.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import lightning as L
import torch

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.data import TensorClients
from fedlight.engine.loop import FederatedLoop
from fedlight.models import MLP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="results/rule_timing.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    clients = [(torch.rand(500, 1, 28, 28, generator=g), torch.randint(0, 10, (500,), generator=g))
               for _ in range(10)]
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    names = fedlight.list_algorithms()
    loops = {}
    for name in names:
        data = TensorClients(clients, batch_size=50)
        data.setup("cpu", 0)
        lr = 1e-3 if name in ("local_adam", "local_adamw", "fedadamw", "fedlada") else 0.1
        cfg = LoopConfig(rounds=args.reps + 1, clients_per_round=10, local_steps=args.steps, lr=lr, progress=False)
        torch.manual_seed(0)
        loops[name] = FederatedLoop(fabric, MLP(), data, fedlight.create(name), cfg, 0, Path("unused"),
                                      data.default_task())
        loops[name].run_round(0)  # warm-up
    times = {n: [] for n in names}
    for r in range(1, args.reps + 1):
        for name in names:
            t = time.perf_counter()
            loops[name].run_round(r)
            times[name].append(time.perf_counter() - t)
    base = times["fedavg"]
    lines = [f"# Seconds per round of every rule relative to FedAvg ({args.reps} interleaved reps)", "",
             f"Command: `OMP_NUM_THREADS=1 python tools/rule_timing.py --reps {args.reps} --steps {args.steps} "
             f"--out {args.out}`  ",
             "Workload: MLP 784-200-200-10, batch 50, 10 clients × "
             f"{args.steps} steps per round, random Fashion-MNIST-shaped data, CPU, 1 torch thread, 32-true.  ",
             "Machine: 2-core AMD EPYC (shared with other jobs; per-repetition ratios cancel most of the drift).", "",
             "| rule | backprops/step | median s/round | × FedAvg (median of paired ratios) |", "|---|---|---|---|"]
    for name in names:
        ratio = statistics.median(t / b for t, b in zip(times[name], base))
        bp = fedlight.get_algorithm(name).backprops
        lines.append(f"| {name} | {bp} | {statistics.median(times[name]):.3f} | {ratio:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
