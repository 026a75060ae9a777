"""Every registered rule on one recipe for a few rounds: accuracy and seconds per round relative to FedAvg.

Resumable (finished rules are skipped; interrupted ones resume), writes results/<name>.jsonl and a Markdown
table. Usage:
    FEDLIGHT_DATA=../shared/data python tools/algo_sweep.py --rounds 50 --out runs/sweep_fmnist \\
        --table results/algorithms_fmnist_dir0.1.md
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import fedlight

# Per-rule settings that differ from the recipe: the FedWMSAM paper's ρ values for its Fashion-MNIST column,
# and a learning rate suited to Adam-type local optimizers (the recipe's 0.1 is an SGD learning rate).
OVERRIDES = {
    "fedsam": ["--algorithm.rho", "0.01"], "fedgamma": ["--algorithm.rho", "0.01"],
    "fedlesam": ["--algorithm.rho", "0.01"], "fedlesam_s": ["--algorithm.rho", "0.01"],
    "fedlesam_d": ["--algorithm.rho", "0.01"], "fedwmsam": ["--algorithm.rho", "0.01"],
    "fedsmoo": ["--algorithm.rho", "0.1"], "mofedsam": ["--algorithm.rho", "0.1"],
    "local_adam": ["--loop.lr", "0.001"], "local_adamw": ["--loop.lr", "0.001"],
    "fedadamw": ["--loop.lr", "0.001"], "fedlada": ["--loop.lr", "0.001"],
}
PAPER_FMNIST_DIR01 = {"fedavg": 82.26, "fedcm": 73.33, "scaffold": 83.51, "fedsam": 82.61, "mofedsam": 74.89,
                      "fedgamma": 82.98, "fedsmoo": 83.37, "fedlesam": 83.75, "fedwmsam": 84.64}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="recipes/fedavg_mlp_fmnist_dir0.1.yaml")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--out", default="runs/sweep_fmnist")
    ap.add_argument("--table", default="results/algorithms_fmnist_dir0.1.md")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    names = args.only or ["fedavg"] + [n for n in fedlight.list_algorithms() if n != "fedavg"]
    for name in names:
        out = Path(args.out) / name
        if (out / "summary.json").exists() and json.loads((out / "summary.json").read_text())[
                "rounds_completed"] >= args.rounds:
            continue
        cmd = [sys.executable, "-m", "fedlight.config.cli", "fit", "--config", args.recipe, "--algorithm", name,
               "--loop.rounds", str(args.rounds), "--loop.eval_every", "5", "--loop.save_every", "5",
               "--out_dir", str(out), "--resume", "auto", "--loop.progress", "false", *OVERRIDES.get(name, [])]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=False)
    write_table(Path(args.out), Path(args.table), args)


def write_table(root: Path, table: Path, args) -> None:
    rows = {}
    for d in sorted(root.iterdir()):
        if (d / "summary.json").exists():
            rows[d.name] = json.loads((d / "summary.json").read_text())
            times = sorted(json.loads(x)["round_time_s"] for x in (d / "metrics.jsonl").read_text().splitlines())
            rows[d.name]["seconds_per_round"] = times[len(times) // 2]  # median: robust to load spikes
    base = rows.get("fedavg", {}).get("seconds_per_round")
    lines = [f"# Every rule, {args.rounds} rounds: `{args.recipe}`", "",
             f"Command: `FEDLIGHT_DATA=../shared/data python tools/algo_sweep.py --rounds {args.rounds} "
             f"--out {args.out} --table {args.table}`  ",
             f"Hardware: {platform.processor() or platform.machine()}, {_cpu()}; torch threads as default; "
             "other processes shared the 2 cores, so seconds are noisy (ratios are within one sweep).  ",
             "Settings: the recipe (100 clients, 10/round, 5 local epochs, batch 50, lr 0.1·0.998^r, wd 1e-3, "
             "clip 10) with rule defaults, except ρ per the FedWMSAM paper (0.01: FedSAM, FedGAMMA, FedLESAM*, "
             "FedWMSAM; 0.1: FedSMOO, MoFedSAM) and lr 1e-3 for Adam-type local optimizers. One seed (0).", "",
             "| rule | test acc @ final round | best | median s/round | × FedAvg "
             "| paper (500 rounds, FMNIST Dir 0.1) |",
             "|---|---|---|---|---|---|"]
    for name, s in rows.items():
        spr = s.get("seconds_per_round")
        ratio = f"{spr / base:.2f}" if spr and base else "-"
        acc = s.get("final_test_acc")
        best = s.get("best_test_acc")
        paper = PAPER_FMNIST_DIR01.get(name)
        lines.append(f"| {name} | {'-' if acc is None else f'{100 * acc:.2f}'} | "
                     f"{'-' if best is None else f'{100 * best:.2f}'} | {spr or 0:.3f} | {ratio} | "
                     f"{'' if paper is None else paper} |")
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text("\n".join(lines) + "\n")
    print(table.read_text())


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    main()
