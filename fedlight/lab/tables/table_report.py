"""``fedlight reproduce``'s ``table.md`` / ``table.csv`` / ``curves*.png``: each cell's measured mean ± std next to the
paper's value, the gap to a baseline row paired by seed, and (with ``--tuned``) the values each row ran at."""

from __future__ import annotations

import csv
import io
import json
import re
import statistics
from pathlib import Path
from typing import Any

from fedlight.lab.tables.report import hardware, metric_label, read_summary, stats
from fedlight.lab.tables.report_plot import check_curve_keys, plot_curves


def paper_value(spec: dict, cell) -> Any:
    return ((spec.get("paper") or {}).get(cell.row) or {}).get(cell.col)


def number(v: Any) -> float | None:
    """The leading number of a paper value (``66.04 ± 0.11`` → 66.04); None for text like ``not reached``."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    m = re.match(r"\s*(-?\d+(?:\.\d+)?)", str(v)) if v is not None else None
    return float(m.group(1)) if m else None


def _accuracy(metric: str) -> bool:
    return metric in ("final_test_acc", "best_test_acc") or metric.startswith("last_test_acc:")


def _sign(x: float, digits: int) -> str:
    r = round(x, digits)
    return "+" if r > 0 else "-" if r < 0 else "0"


def baseline_gaps(spec: dict, cs: list) -> dict[tuple[str, str], dict[str, Any]]:
    """Each cell's gap to the spec's ``baseline`` row in its column, per metric: ``gap`` = mean over the seeds both
    finished of (cell − baseline), ``pairs`` = how many seeds; ``paper_gap`` = paper(cell) − paper(baseline);
    ``same_sign``: whether the two gaps have one sign at the shown digits (None where either is missing or the
    metric is not comparable with the paper's, which is an accuracy)."""
    base = spec.get("baseline")
    if not base:
        return {}
    grid = {(c.row, c.col): c for c in cs}
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for c in cs:
        b = grid.get((base, c.col))
        if b is None:
            continue
        pc, pb = number(paper_value(spec, c)), number(paper_value(spec, b))
        paper_gap = pc - pb if pc is not None and pb is not None else None
        for m in [c.metric, *spec.get("also", [])]:
            pairs = [(float(x), float(y)) for x, y in zip(c.values.get(m, []), b.values.get(m, []))
                     if x not in ("missing", None) and y not in ("missing", None)]
            gap = statistics.fmean(x - y for x, y in pairs) if pairs else None
            digits = stats(m, c.values.get(m, []))["digits"]
            comparable = m == c.metric or (_accuracy(m) and _accuracy(c.metric))
            same = (None if gap is None or paper_gap is None or not comparable
                    else _sign(gap, digits) == _sign(paper_gap, digits))
            out[(c.name, m)] = {"gap": gap, "pairs": len(pairs), "paper_gap": paper_gap, "same_sign": same,
                                "digits": digits}
    return out


def gap_lines(spec: dict, cs: list, gaps: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """The table.md section of :func:`baseline_gaps` (empty without a ``baseline``)."""
    if not gaps:
        return []
    base, metrics = spec["baseline"], list(dict.fromkeys(m for _, m in gaps))
    lines = [f"## Gap to {base} (same column, paired by seed)", "",
             f"Measured: mean over the seeds both cells finished of (cell − {base}), with that number of seeds. "
             f"Paper: paper(cell) − paper({base}). `=` / `≠`: the measured gap has / has not the paper gap's sign "
             "(0 at the shown digits is a sign of its own).", "",
             f"| cell | paper gap | {' | '.join(metrics)} |", f"|---|---:|{'---:|' * len(metrics)}"]
    for c in cs:
        if (c.name, c.metric) not in gaps:
            continue
        pg = gaps[(c.name, c.metric)]["paper_gap"]
        items = []
        for m in metrics:
            g = gaps.get((c.name, m))
            if g is None or g["gap"] is None:
                items.append("-")
                continue
            mark = {True: " =", False: " ≠", None: ""}[g["same_sign"]]
            items.append(f"{g['gap']:+.{g['digits']}f}{mark} ({g['pairs']})")
        lines.append(f"| {c.name} | {'-' if pg is None else format(pg, '+.2f')} | {' | '.join(items)} |")
    return lines + [""]


def _gap_fields(g: dict[str, Any] | None) -> list[str]:
    if g is None:
        return ["", "", "", ""]
    return ["" if g["gap"] is None else repr(g["gap"]), str(g["pairs"]),
            "" if g["paper_gap"] is None else repr(g["paper_gap"]),
            "" if g["same_sign"] is None else str(g["same_sign"]).lower()]


def _own_metrics(spec: dict, cs: list) -> str:
    """The columns whose cells report another metric than the spec's, e.g. " (column cola: final test MCC (%))"."""
    own = {c.col: c.metric for c in cs if c.metric != spec["metric"]}
    return "".join(f" (column {col}: {metric_label(m)})" for col, m in own.items())


def write_table(spec: dict, spec_path: Path, cs: list, done: list[tuple[Any, Path]], seeds: list[int], out: Path,
                command: str, shrink: str | None, jobs: int, previous: str | None = None,
                tuned: dict[str, str] | None = None) -> str:
    """``fedlight reproduce``'s output: ``table.md``, ``table.csv`` and ``curves*.png`` (one figure per column that
    has its own runs, one line per row). ``cs``: the table's cells (``reproduce.Cell`` with their values filled);
    ``done``: (cell, run folder) of every finished run; ``previous``: the earlier table.csv some seeds' values were
    taken from (``Cell.earlier`` counts them); ``tuned``: row -> the tuned values its cells ran at (a column)."""
    from fedlight.run.files import atomic_write_text, git_revision

    runs = [path for _, path in done]
    keys = check_curve_keys(runs, spec.get("curves", []), f"table spec {spec_path}: `curves`", strict=False)
    revs = sorted({v for c in cs for v in c.revisions} - {"missing", "earlier"})
    borrowed = sum(c.earlier for c in cs)
    rounds = sorted({(read_summary(r) or {}).get("rounds_completed") for r in runs} - {None})
    lines = [f"# {spec['title']}", "",
             f"- Spec: `{spec_path}` · base recipe `{spec['base']}`",
             f"- Metric: {metric_label(spec['metric'])}" + _own_metrics(spec, cs) + "".join(
                 f"; also {metric_label(m)}" for m in spec.get("also", [])),
             f"- Seeds: {', '.join(map(str, seeds))} (mean ± sample std over seeds) · rounds: "
             f"{', '.join(map(str, rounds)) or '-'} · shrink: {shrink or 'none (full scale)'} · jobs: {jobs}",
             f"- Hardware: {hardware(runs)}",
             f"- fedlight revision: {git_revision()} (runs made at: {', '.join(revs) or '-'})",
             f"- Command: `{command}`", f"- Run directories under `{out}`"]
    if previous:
        lines.append(f"- Earlier values: {borrowed} of {sum(len(c.revisions) for c in cs)} runs' values come from "
                     f"`{previous}` (an earlier table of this spec; their run directories are not under `{out}`)")
    lines += ["",
             "## How this differs from the paper", "", str(spec.get("notes", "")).strip() or "-", ""]
    cols = list(dict.fromkeys(c.col for c in cs))
    extra = ["tuned values"] if tuned else []
    lines += ["## Measured / paper", "", f"| | {' | '.join(cols + extra)} |", f"|---|{'---:|' * len(cols)}"
              + "---|" * len(extra)]
    grid = {(c.row, c.col): c for c in cs}
    for row in dict.fromkeys(c.row for c in cs):
        items = []
        for col in cols:
            c = grid.get((row, col))
            p = paper_value(spec, c) if c else None
            items.append("" if c is None else stats(c.metric, c.values[c.metric])["text"] +
                         (f" / {p}" if p is not None else "") + (f" [{c.diverged} diverged]" if c.diverged else ""))
        lines.append(f"| {row} | {' | '.join(items + ([tuned.get(row, '-')] if tuned else []))} |")
    gaps = baseline_gaps(spec, cs)
    lines += ["", *gap_lines(spec, cs, gaps), "## Cells", "",
              "| cell | metric | paper | measured | measured − paper | run directory |", "|---|---|---:|---:|---:|---|"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["cell", "row", "column", "metric", "paper", "mean", "std", "n", "difference", "values", "run_dir",
                "baseline_gap", "baseline_pairs", "paper_gap", "same_sign_as_paper", "revisions"])
    for c in cs:
        for m in [c.metric, *spec.get("also", [])]:
            s, p = stats(m, c.values[m]), paper_value(spec, c) if m == c.metric else None
            diff = s["mean"] - number(p) if s["mean"] is not None and number(p) is not None and \
                s["n"] == len(c.values[m]) else None
            run_dir = out / c.run_key
            d = "-" if diff is None else format(diff, f"+.{s['digits']}f")
            lines.append(f"| {c.name} | {m} | {'-' if p is None else p} | {s['text']} | {d} | `{run_dir}` |")
            w.writerow([c.name, c.row, c.col, m, "" if p is None else p, "" if s["mean"] is None else repr(s["mean"]),
                        "" if s["std"] is None else repr(s["std"]), s["n"], "" if diff is None else repr(diff),
                        json.dumps(c.values[m]), str(run_dir), *_gap_fields(gaps.get((c.name, m))),
                        json.dumps(c.revisions)])
    atomic_write_text(out / "table.md", "\n".join(lines) + "\n")
    atomic_write_text(out / "table.csv", buf.getvalue())
    figures: dict[str, dict[str, list[Path]]] = {}
    for cell, path in done:
        figures.setdefault(cell.run_key.split("/")[1], {}).setdefault(cell.row, []).append(path)
    if len(figures) == 1:
        figures = {"": next(iter(figures.values()))}
    for fig, groups in figures.items():
        plot_curves(groups, out / f"curves{'_' + fig if fig else ''}.png", f"{spec['title']} {fig}".strip(), keys)
    return "\n".join(lines)
