"""The curves of finished runs (``curves.png``, ``curves*.png``) and ``fedlight report RUN_DIR...``, which writes
them next to the comparison table of :mod:`fedlight.lab.tables.report`.

A figure has a panel for the headline test metric and one for the train loss against rounds, then one panel per
extra per-round key of ``metrics.jsonl`` asked for (``--curves server/momentum_variance``, a table spec's
``curves:``); one line per run (or, from ``fedlight reproduce``, one line per cell: the mean curve over its seeds),
like the papers' figures.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlight.errors import check
from fedlight.lab.tables.report import csv_text, find_runs, headline, markdown_table, metric_label, read_curve, run_rows
from fedlight.run.files import is_fraction


def mean_curve(runs: list[Path], key: str) -> tuple[list[int], list[float]]:
    """Per-round mean of ``key`` over ``runs`` (rounds where at least one run has a value)."""
    by_round: dict[int, list[float]] = {}
    for run in runs:
        for row in read_curve(run):
            v = row.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                by_round.setdefault(int(row["round"]), []).append(float(v))
    rounds = sorted(by_round)
    return rounds, [sum(by_round[r]) / len(by_round[r]) for r in rounds]


def _numeric_keys(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in rows for k, v in r.items()
                   if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)})


def check_curve_keys(runs: list[Path], keys: Sequence[str], where: str, strict: bool = True) -> list[str]:
    """The ``keys`` that some round of ``runs`` reports. A key that none reports is refused
    (:class:`~fedlight.errors.ConfigError`, naming the per-round numeric keys of the first run), or with
    ``strict=False`` left out of the figure with that line printed as a warning (``fedlight reproduce``: its runs
    are done by then, and the table is still worth writing)."""
    if not runs or not keys:
        return list(keys)
    curves = [read_curve(r) for r in runs]
    kept = []
    for key in keys:
        found = any(key in row for rows in curves for row in rows)
        line = (f"{where}: no round of the runs reports `{key}`; the per-round keys of {runs[0]} are "
                f"{', '.join(_numeric_keys(curves[0])) or 'none'}")
        check(found or not strict, line)
        if found:
            kept.append(key)
        else:
            print(f"fedlight: warning: {line} (left out of the figure; fix the spec and rerun with --table-only)",
                  file=sys.stderr)
    return kept


def _style(ax, label: str, values: list[float], span: float) -> None:
    """Round axis, y label and grid; a log y-axis when every value is positive and the largest is over ``span``
    times the smallest (0 for the loss: any positive losses; 100 for an extra key: more than two decades)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if values and min(values) > 0 and max(values) > span * min(values):
        ax.set_yscale("log")
        ax.set_ylabel(f"{label} (log scale)")
        ax.grid(alpha=0.3, which="both")


def curves_figure(groups: dict[str, list[Path]], title: str = "", keys: Sequence[str] = ()):
    """The headline test metric (accuracy in %) and train loss against rounds, then one panel per per-round key in
    ``keys``, one line per group (mean over its runs), as a ``Figure`` (two panels a row).

    The loss panel is on a log axis (when every loss is positive), so one diverging rule does not flatten the rest;
    an extra panel when its values are positive and span more than two decades.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = (3 + len(keys)) // 2
    fig = Figure(figsize=(11, 4.2 * rows), dpi=100)
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, 2).flat)
    for spare in axes[2 + len(keys):]:
        fig.delaxes(spare)
    key = headline(next(iter(groups.values()))[0])[0] if groups else "test_acc"
    scale = 100 if is_fraction(key) else 1
    panels = [(key, scale), ("train_loss", 1), *((k, 1) for k in keys)]
    values: list[list[float]] = [[] for _ in panels]
    for label, runs in groups.items():
        label = label if len(runs) == 1 else f"{label} (mean of {len(runs)})"
        for ax, (k, s), vals in zip(axes, panels, values):
            r, ys = mean_curve(runs, k)
            if r:
                ax.plot(r, [s * y for y in ys], label=label, lw=1.4, marker="o" if len(r) < 12 else None, ms=3)
                vals += ys
    _style(axes[0], metric_label(f"final_{key}").removeprefix("final "), [], 0)
    _style(axes[1], "train loss", values[1], 0)
    for ax, k, vals in zip(axes[2:], keys, values[2:]):
        _style(ax, k, vals, 100)
    axes[1].legend(fontsize=7, loc="best", ncol=1 + len(groups) // 12)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_curves(groups: dict[str, list[Path]], path: Path, title: str = "", keys: Sequence[str] = ()) -> Path:
    """Write :func:`curves_figure` as a PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    curves_figure(groups, title, keys).savefig(path)
    return path


def cmd_report(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fedlight report", description="Finished runs -> comparison table (report.md, "
                                "report.csv) and curves.png (test accuracy and train loss against rounds).")
    p.add_argument("runs", nargs="+", help="run directories (or folders searched for them)")
    p.add_argument("--out", default="runs/report", help="where report.md, report.csv and curves.png go")
    p.add_argument("--title", default="", help="plot title")
    p.add_argument("--curves", default="", metavar="KEY[,KEY...]", help="more panels in curves.png: per-round keys "
                   "of metrics.jsonl, e.g. server/momentum_variance,server/avg_momentum_norm")
    args = p.parse_args(argv)
    from fedlight.run.files import atomic_write_text

    runs = find_runs(args.runs)
    keys = [k.strip() for k in args.curves.split(",") if k.strip()]
    check_curve_keys(runs, keys, "`fedlight report --curves`")
    rows = run_rows(runs)
    out = Path(args.out)
    md = markdown_table(rows)
    atomic_write_text(out / "report.md", f"# Run comparison\n\n{md}")
    atomic_write_text(out / "report.csv", csv_text(rows))
    plot_curves({r["run"]: [run] for r, run in zip(rows, runs)}, out / "curves.png", args.title, keys)
    print(md)
    print(f"wrote {out / 'report.md'}, {out / 'report.csv'}, {out / 'curves.png'}")
    return 0
