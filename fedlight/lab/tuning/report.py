"""``tune.md`` / ``tune.csv`` / ``tune_<row>.png`` of a ``fedlight tune`` study, read from its storage: per row the
best values, the objective of every trial, how many were pruned, Optuna's parameter importances, and the objective
against each parameter (matplotlib, as ``fedlight report`` plots), and a best value at the edge of its range (the
search did not bracket the optimum: widen that range, docs/tuning.md)."""

from __future__ import annotations

import csv
import io
import json
import math
import textwrap
from pathlib import Path
from typing import Any

from fedlight.lab.tables import report as rep

EDGE = 0.05
"""A best value within this fraction of its range from a bound (on the log scale where the range is log) is at the
edge of the space: the search has not bracketed the optimum in that setting."""


def write(job, command: str) -> str:
    """Write the three outputs beside the runs (``job``: a :class:`fedlight.lab.tuning.cli.Job`); the Markdown text.

    Workers sharing a study each write these when they stop, and a worker's "not finished" report, read while
    another ran its last trial, may land after that worker's "budget spent" one: so a report written unspent is
    written again if the study is spent once it is on disk (the last write is never older than the study)."""
    while True:
        text, spent = _write(job, command)
        if spent or not _spent(job):
            return text


def _spent(job, trials=None) -> bool:
    """Every row has its trials, none running (``trials``: the rows' trials as read; else read now)."""
    import optuna

    running = optuna.trial.TrialState.RUNNING
    rows = trials if trials is not None else [s.get_trials(deepcopy=False) for s in job.studies.values()]
    return all(len(ts) >= job.tune.trials and not any(t.state == running for t in ts) for ts in rows)


def _write(job, command: str) -> tuple[str, bool]:
    import optuna

    from fedlight.run.files import atomic_write_text, git_revision

    tune, states = job.tune, optuna.trial.TrialState
    studies = {row: s.get_trials(deepcopy=False) for row, s in job.studies.items()}
    spent = _spent(job, studies.values())
    lines = [f"# Tuning: {job.spec['title']}", "",
             f"- Spec: `{job.spec_path}` · base recipe `{job.spec['base']}` · column `{tune.column}`",
             f"- Objective: {tune.objective} ({rep.metric_label(tune.objective)}; "
             f"{'higher' if job.maximize else 'lower'} is better), mean over {tune.seeds} seed(s) per trial",
             f"- Budget: {tune.trials} trials per row × {tune.rounds} rounds · sampler {tune.sampler} · pruner "
             f"{tune.pruner} · shrink: {job.shrink or 'none (full scale)'}",
             f"- Study: `{job.url}`, studies {', '.join(f'`{s.study_name}`' for s in job.studies.values())}",
             f"- State: {'budget spent: every trial finished' if spent else 'not finished: the same command goes on'}",
             f"- Hardware: {rep.hardware([])} · fedlight revision: {git_revision()}",
             f"- Command: `{command}`", "",
             "| row | finished | pruned | failed | running | best objective | best values | best trial |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["row", "trial", "state", "objective", "params", "best", "run_dir"])
    detail = []
    for row, trials in studies.items():
        count = {s: sum(t.state == s for t in trials) for s in (states.COMPLETE, states.PRUNED, states.FAIL,
                                                                   states.RUNNING)}
        done = [t for t in trials if t.state == states.COMPLETE]
        best = (max if job.maximize else min)(done, key=lambda t: t.value) if done else None
        lines.append(f"| {row} | {count[states.COMPLETE]} | {count[states.PRUNED]} | {count[states.FAIL]} | "
                     f"{count[states.RUNNING]} | {_num(best.value) if best else '-'} | "
                     f"{_params(best.params) if best else '-'} | {best.number if best else '-'} |")
        detail += [f"## {row}", "", f"Importances (Optuna's fANOVA): {importances(job.studies[row])}", "",
                   f"![objective against each parameter](tune_{row}.png)", "",
                   "| trial | state | objective | values | run directory |", "|---:|---|---:|---|---|"]
        for t in trials:
            value = t.value if t.state == states.COMPLETE else _last(t)
            run_dir = job.out / row / f"trial{t.number:03d}"
            detail.append(f"| {t.number} | {t.state.name.lower()} | {_num(value)}"
                          f"{' (last report)' if value is not None and t.state != states.COMPLETE else ''} | "
                          f"{_params(t.params)} | `{run_dir}` |")
            w.writerow([row, t.number, t.state.name.lower(), "" if value is None else repr(value),
                        json.dumps(t.params), str(best is not None and t.number == best.number).lower(), run_dir])
        detail.append("")
        plot(row, trials, job.tune.space[row], job.out / f"tune_{row}.png", tune.objective)
    text = "\n".join([*lines, "", *edge_report(job), "", *detail])
    atomic_write_text(job.out / "tune.md", text + "\n")
    atomic_write_text(job.out / "tune.csv", buf.getvalue())
    return text, spent


def position(value: Any, dist: dict[str, Any]) -> float | None:
    """Where ``value`` lies in its range: 0 at ``low``, 1 at ``high``, on the log scale where ``log: true``; None
    for ``choices``."""
    if "low" not in dist or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    scale = math.log if dist.get("log") else float
    lo, hi = scale(dist["low"]), scale(dist["high"])
    return (scale(value) - lo) / (hi - lo)


def edges(job) -> dict[str, list[str]]:
    """Row -> its best trial's values within :data:`EDGE` of a bound of their ranges, each as a phrase."""
    import optuna

    out: dict[str, list[str]] = {}
    for row, study in job.studies.items():
        done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if not done:
            continue
        best = (max if job.maximize else min)(done, key=lambda t: t.value)
        for key, dist in job.tune.space[row].items():
            p = position(best.params.get(key), dist)
            if p is not None and min(p, 1 - p) <= EDGE:
                side = "high" if p > 0.5 else "low"
                out.setdefault(row, []).append(
                    f"{key} = {_num(best.params[key])} lies {min(p, 1 - p):.1%} of its range from its {side} bound "
                    f"{_num(dist[side])}{' (log scale)' if dist.get('log') else ''}")
    return out


def edge_report(job) -> list[str]:
    """The lines of ``tune.md`` on best values at the edge of the space (or that there are none)."""
    found = edges(job)
    if not found:
        return [f"Every best value of a range lies inside it (more than {EDGE:.0%} of the range from each bound, on "
                "the log scale where the range is log)."]
    return [f"**Best at the edge of the space** (within {EDGE:.0%} of a bound; on the log scale where the range is "
            "log): the search did not bracket the optimum there, so the best value may lie beyond the bound. Widen "
            "that range past the bound and tune again with a new `--out` (docs/tuning.md, \"Best at the edge\").", "",
            *(f"- {row}: {'; '.join(items)}" for row, items in found.items())]


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}"


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={_num(v) if isinstance(v, float) else v}" for k, v in params.items())


def _last(t) -> float | None:
    """A pruned (or unfinished) trial's last reported value."""
    return t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None


def importances(study) -> str:
    """Optuna's parameter importances (its default evaluator), or why there are none yet."""
    import optuna

    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(done) < 2:
        return f"- (needs 2 finished trials, has {len(done)})"
    try:
        imp = optuna.importance.get_param_importances(study)
    except (ValueError, RuntimeError) as e:
        return f"- ({e})"
    return ", ".join(f"{k} {v:.2f}" for k, v in imp.items()) or "-"


def plot(row: str, trials: list, space: dict[str, dict[str, Any]], path: Path, objective: str) -> Path:
    """Objective against each parameter of ``row``: finished trials filled, pruned ones hollow (last report)."""
    import optuna
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(space), 3.4), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(space), squeeze=False, sharey=True)[0]
    axes[0].set_ylabel("\n".join(textwrap.wrap(rep.metric_label(objective), 34)), fontsize=9)  # one, wrapped
    for ax, (key, dist) in zip(axes, space.items()):
        for state, filled in ((optuna.trial.TrialState.COMPLETE, True), (optuna.trial.TrialState.PRUNED, False)):
            pts = [(t.params[key], t.value if filled else _last(t)) for t in trials
                   if t.state == state and key in t.params]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                xs = [x if not isinstance(x, str) else str(x) for x, _ in pts]
                ax.scatter(xs, [y for _, y in pts], label=state.name.lower(),
                           facecolors=None if filled else "none", edgecolors="C0" if filled else "C1")
        if dist.get("log"):
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    fig.suptitle(f"{row}: objective per trial", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
