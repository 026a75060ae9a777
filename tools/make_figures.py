"""Regenerate every picture of the README and the results pages from files committed under ``results/``.

    python tools/make_figures.py            # writes docs/img/*.png
    python tools/make_figures.py --check    # also fails if a picture is 300 kB or more

Each figure reads only committed files (named in its function's docstring), so a picture never shows a number its
page cannot point to. Needs matplotlib (in the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
OUT = ROOT / "docs" / "img"
MAX_BYTES = 300_000
COLORS = {"fedavg": "#1f77b4", "fedwmsam": "#d62728", "fedsam": "#2ca02c", "fedlesam": "#9467bd"}


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _md_rows(name: str, pattern: str, sort_by: int) -> list[list[str]]:
    """The cells of the rows of ``results/<name>``'s Markdown table that match ``pattern``, sorted by the number in
    column ``sort_by``."""
    table = [ln.split("|")[1:-1] for ln in (RESULTS / name).read_text().splitlines() if re.match(pattern, ln)]
    return sorted(table, key=lambda c: float(c[sort_by]))


def _save(fig, name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _label_bars(ax, names: list[str], rotation: int, fontsize: int, **labels) -> None:
    """A bar chart's names under its bars (rotated), its ``ax.set`` labels and title, a y grid and the legend."""
    ax.set_xticks(range(len(names)), names, rotation=rotation, ha="right", fontsize=fontsize)
    ax.set(**labels)
    ax.title.set_fontsize(10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def fmnist_curves() -> Path:
    """FedAvg vs FedWMSAM, each at its tuned values, 3 seeds, 500 rounds:
    ``results/fedwmsam_tuned_fmnist/test_acc_by_round.csv`` (the paper's values: ``.../table.csv``)."""
    rows = _rows(RESULTS / "fedwmsam_tuned_fmnist" / "test_acc_by_round.csv")
    paper = {r["row"]: float(r["paper"]) for r in _rows(RESULTS / "fedwmsam_tuned_fmnist" / "table.csv")
             if r["metric"] == "final_test_acc" and r["paper"]}
    fig, ax = plt.subplots(figsize=(8, 3.4))
    rounds = [int(r["round"]) for r in rows]
    for rule, label in (("fedavg", "FedAvg"), ("fedwmsam", "FedWMSAM")):
        cols = [c for c in rows[0] if c.startswith(f"{rule}_seed")]
        per_round = [[float(r[c]) for c in cols if r[c]] for r in rows]
        mean = [statistics.fmean(v) for v in per_round]
        ax.fill_between(rounds, [min(v) for v in per_round], [max(v) for v in per_round], color=COLORS[rule],
                        alpha=0.15, linewidth=0)
        ax.plot(rounds, mean, color=COLORS[rule], linewidth=1.2, label=f"{label} (mean of {len(cols)} seeds)")
        if rule in paper:
            ax.axhline(paper[rule], color=COLORS[rule], linestyle="--", linewidth=0.9,
                       label=f"{label}, paper's value after 500 rounds ({paper[rule]:.2f})")
    ax.set(xlabel="round", ylabel="test accuracy (%)", ylim=(60, 90), xlim=(1, rounds[-1]),
           title="Fashion-MNIST, Dir(0.1), MLP, 100 clients (10 per round), each rule at its tuned values")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, "fmnist_dir0.1_curves.png")


def table1_measured_vs_paper() -> Path:
    """Final test accuracy after 500 rounds on Fashion-MNIST Dir(0.1), measured (mean ± sample std over the seeds
    that ran) against FedWMSAM's Table 1: ``results/fedwmsam_table1_fmnist/table.csv``."""
    rows = [r for r in _rows(RESULTS / "fedwmsam_table1_fmnist" / "table.csv")
            if r["column"] == "fmnist_dir0.1" and r["metric"] == "final_test_acc" and r["paper"]]
    rows.sort(key=lambda r: float(r["paper"].split()[0]))
    names = [r["row"] for r in rows]
    paper = [float(r["paper"].split()[0]) for r in rows]
    mean = [float(r["mean"]) for r in rows]
    std = [float(r["std"]) if r["std"] else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], paper, width=0.4, color="#bbbbbb", label="paper (Table 1)")
    ax.bar([x + 0.2 for x in xs], mean, width=0.4, yerr=std, color="#1f77b4", capsize=2,
           label="fedlight (mean ± std over seeds)")
    _label_bars(ax, names, 30, 8, ylabel="final test accuracy (%)", ylim=(70, 90),
                title="FedWMSAM's Table 1, Fashion-MNIST Dir(0.1), 500 rounds: measured vs paper")
    return _save(fig, "fmnist_dir0.1_table1.png")


def algorithms_50_rounds() -> Path:
    """Every registered rule after 50 rounds (one seed), from the table of ``results/algorithms_fmnist_dir0.1.md``."""
    table = _md_rows("algorithms_fmnist_dir0.1.md", r"\| [a-z_]+ \| [0-9.]+ \|", 1)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    names = [c[0].strip() for c in table]
    ax.bar(names, [float(c[1]) for c in table], color="#1f77b4", label="fedlight, final round (50 rounds, seed 0)")
    papered = [(i, float(c[5])) for i, c in enumerate(table) if c[5].strip()]
    ax.scatter([i for i, _ in papered], [v for _, v in papered], color="black", marker="_", s=200, zorder=3,
               label="paper (500 rounds)")
    _label_bars(ax, names, 60, 7, ylabel="test accuracy (%)", ylim=(50, 90),
                title="Every rule, Fashion-MNIST Dir(0.1), 50 rounds")
    return _save(fig, "algorithms_fmnist_dir0.1.png")


def privacy_curves() -> Path:
    """FedAvg, FedSAM and FedLESAM without DP and under client-level DP at ε = 8 (adaptive or fixed clip), mean of
    3 seeds: test accuracy (every 5 rounds) and training loss (every round):
    ``results/privacy_fmnist_seeds/rounds.csv``."""
    rows = _rows(RESULTS / "privacy_fmnist_seeds" / "rounds.csv")
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(9, 3.2))
    styles = {"fedavg": "-", "fedsam": "--", "fedlesam": ":"}
    colors = {"no_dp": "black", "eps8_fixed": "#2ca02c", "eps8_adaptive": "#d62728"}
    names = {"no_dp": "no DP", "eps8_fixed": "ε = 8, fixed clip", "eps8_adaptive": "ε = 8, adaptive clip"}
    for column, color in colors.items():
        for rule, style in styles.items():
            for ax, key in ((acc_ax, "test_acc"), (loss_ax, "train_loss")):
                by_round: dict[int, list[float]] = defaultdict(list)
                for r in rows:
                    if r["rule"] == rule and r["column"] == column and r[key]:
                        by_round[int(r["round"])].append(float(r[key]) * (100 if key == "test_acc" else 1))
                rounds = sorted(by_round)
                ax.plot(rounds, [statistics.fmean(by_round[k]) for k in rounds], color=color, linestyle=style,
                        linewidth=1.1, marker="o" if key == "test_acc" else None, markersize=3,
                        label=f"{rule}, {names[column]}" if ax is acc_ax else None)
    acc_ax.set(xlabel="round", ylabel="test accuracy (%)", title="test accuracy (mean of 3 seeds)")
    loss_ax.set(xlabel="round", ylabel="training loss", yscale="log", title="training loss (mean of 3 seeds)")
    for ax in (acc_ax, loss_ax):
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3)
    fig.legend(fontsize=7, ncol=3, loc="lower center", bbox_to_anchor=(0.5, -0.2))
    return _save(fig, "privacy_fmnist.png")


def lockstep_partial() -> Path:
    """Test accuracy of the LeNet-5 CIFAR-10 runs that the GPU window started and did not finish, mean over the
    seeds of each row: ``results/gpu_window_2026-11-28_lockstep/partial_test_acc.csv``."""
    by_row: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in _rows(RESULTS / "gpu_window_2026-11-28_lockstep" / "partial_test_acc.csv"):
        by_row[r["run"].split("/")[0]][int(r["round"])].append(float(r["test_acc"]))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for row, pts in sorted(by_row.items()):
        seeds = max(len(v) for v in pts.values())
        full = sorted(k for k in pts if len(pts[k]) == seeds)
        line, = ax.plot(full, [statistics.fmean(pts[k]) for k in full], linewidth=1.1, label=f"{row} ({seeds} seeds)")
        rest = sorted(k for k in pts if len(pts[k]) < seeds and k > full[-1])
        if rest:  # one seed went on further than the others
            ax.plot([full[-1], *rest], [statistics.fmean(pts[full[-1]]), *(pts[k][0] for k in rest)],
                    color=line.get_color(), linestyle="--", linewidth=1.0, label=f"{row} (one seed, further)")
    ax.set(xlabel="round", ylabel="test accuracy (%)",
           title="LeNet-5, CIFAR-10, Dir(0.6): the unfinished runs of the GPU window (mean over seeds)")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, "gpu_lockstep_partial.png")


def fedcm_client_beta() -> Path:
    """FedCM-client's β sweep: final test accuracy per β and lr, from the committed runs'
    ``results/fedcm_client_beta_fmnist/runs/*/*/*/summary.json``."""
    acc: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted((RESULTS / "fedcm_client_beta_fmnist" / "runs").glob("beta_*/lr*/seed*/summary.json")):
        s = json.loads(path.read_text())
        beta, lr = float(path.parts[-4].removeprefix("beta_")), path.parts[-3].removeprefix("lr")
        acc[lr][beta].append(100 * float(s["final_test_acc"]))
    fig, ax = plt.subplots(figsize=(6, 3))
    for lr, pts in sorted(acc.items()):
        betas = sorted(pts)
        ax.errorbar(betas, [statistics.fmean(pts[b]) for b in betas],
                    yerr=[statistics.stdev(pts[b]) if len(pts[b]) > 1 else 0 for b in betas],
                    marker="o", capsize=3, label=f"lr {lr}")
    ax.set(xlabel="β (client momentum)", ylabel="final test accuracy (%)",
           title="FedCM-client on Fashion-MNIST Dir(0.1): accuracy against β")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, "fedcm_client_beta.png")


def performance_pairs() -> Path:
    """The per-pair round-time ratios of fedlight, a minimal PyTorch loop and pfl-research, as printed verbatim in
    ``results/performance.md`` (§11.7's bench output)."""
    text = (RESULTS / "performance.md").read_text()
    pairs = {}
    for label, pattern in (("fedlight / minimal", r"fedlight / minimal: median round ratio .*?\[([0-9., ]+)\], 96"),
                           ("pfl-research / fedlight", r"pfl / fedlight: median round ratio .*?\[([0-9., ]+)\], 96")):
        pairs[label] = [float(v) for v in re.search(pattern, text).group(1).split(",")]
    fig, ax = plt.subplots(figsize=(7, 2.4))
    for i, (label, values) in enumerate(pairs.items()):
        ax.scatter(values, [i] * len(values), alpha=0.6, s=25)
        ax.plot([statistics.median(values)] * 2, [i - 0.3, i + 0.3], color="black", linewidth=2)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(pairs)), list(pairs))
    ax.set(xlabel="ratio of median round times, per interleaved pair (bar: median of 15 pairs)", ylim=(-0.6, 1.6),
           title="One FedAvg round, MLP on Fashion-MNIST, 2-core CPU, 1 thread")
    ax.title.set_fontsize(10)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, "performance_pairs.png")


def rule_timing() -> Path:
    """Seconds per round of every rule relative to FedAvg: the table of ``results/rule_timing.md``."""
    table = _md_rows("rule_timing.md", r"\| [a-z_]+ \| [12] \|", 3)
    fig, ax = plt.subplots(figsize=(8, 3))
    colors = ["#1f77b4" if c[1].strip() == "1" else "#d62728" for c in table]
    ax.bar([c[0].strip() for c in table], [float(c[3]) for c in table], color=colors)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(table)), [c[0].strip() for c in table], rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="× FedAvg's round", title="Seconds per round relative to FedAvg (blue: one backprop a step, "
           "red: two), MLP, CPU")
    ax.title.set_fontsize(10)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, "rule_timing.png")


def gpu_morning_partial() -> Path:
    """Test accuracy of the LeNet-5 CIFAR-10 runs of the first GPU window, 16 side by side, mean over the seeds of
    each row: ``results/gpu_window_2026-11-28/partial_test_acc.csv``."""
    by_row: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in _rows(RESULTS / "gpu_window_2026-11-28" / "partial_test_acc.csv"):
        by_row[r["row"]][int(r["round"])].append(100 * float(r["test_acc"]))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for row, pts in sorted(by_row.items()):
        rounds = sorted(pts)
        ax.plot(rounds, [statistics.fmean(pts[k]) for k in rounds], linewidth=1.1, label=row)
    ax.set(xlabel="round", ylabel="test accuracy (%)",
           title="LeNet-5, CIFAR-10, Dir(0.6): where the first window's runs stood (mean over the seeds that ran)")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    return _save(fig, "gpu_window_partial.png")


FIGURES = [fmnist_curves, table1_measured_vs_paper, algorithms_50_rounds, privacy_curves, lockstep_partial,
           fedcm_client_beta, performance_pairs, rule_timing, gpu_morning_partial]


def main(argv: list[str] | None = None) -> int:
    global OUT
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if a picture is 300 kB or more")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder for the pictures (default docs/img)")
    args = p.parse_args(argv)
    OUT = args.out
    too_big = []
    for make in FIGURES:
        path = make()
        size = path.stat().st_size
        print(f"{path}  {size / 1000:.0f} kB")
        if size >= MAX_BYTES:
            too_big.append(path.name)
    if args.check and too_big:
        print(f"over {MAX_BYTES // 1000} kB: {', '.join(too_big)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
