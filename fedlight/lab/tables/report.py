"""Finished runs → their metrics and a comparison table (Markdown + CSV), for ``fedlight report RUN_DIR...``
(:mod:`fedlight.lab.tables.report_plot`, which also draws the curves), ``fedlight reproduce`` and ``fedlight tune``.

A run directory is anything holding ``metrics.jsonl`` (one JSON row per round, written by the loop) and, once
finished, ``summary.json``. A directory that is not a run is searched recursively, so
``fedlight report runs/tables/fedwmsam_table1`` reports every run of a reproduced table.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import re
import statistics
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError, check
from fedlight.run.files import is_fraction

METRICS = ("final_test_acc", "best_test_acc", "seconds_per_round", "final_train_loss")
"""The classic metrics; any task metric also works as ``final_test_<m>``, ``best_test_<m>`` or ``last_test_<m>:<k>``
(``test_<m>`` a key of ``metrics.jsonl``, e.g. ``final_test_mse``, ``last_test_perplexity:10``)."""
TASK_METRIC = re.compile(r"^(final|best)_(test_\w+)$|^last_(test_\w+):(\d+)$")
ROUND_METRIC = re.compile(r"^(final|last|var)_(train_loss|update_norm|flatness_distance|[A-Za-z]\w*/[\w/]+)"
                          r"(?::(\d+))?$")
"""A per-round key of ``metrics.jsonl`` that is not a test metric: the loop's ``train_loss``, ``update_norm``,
``flatness_distance``, or a rule's namespaced diagnostic (``server/momentum_variance``, ``rule/...``,
``privacy/epsilon``; a bare name such as ``final_mse`` stays an unknown metric, not a key to look for):
``final_<key>`` its last value, ``last_<key>:<k>`` the mean and ``var_<key>:<k>`` the population variance of its last
``k`` values (e.g. ``var_train_loss:100``, the round-to-round variance of the training loss over the last 100
rounds)."""


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories at or under ``paths`` (those holding ``metrics.jsonl``), in order, without repeats."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise ConfigError(f"`fedlight report`: {p} does not exist")
        found = [p] if (p / "metrics.jsonl").is_file() else sorted(m.parent for m in p.rglob("metrics.jsonl"))
        if not found:
            raise ConfigError(f"`fedlight report`: no run under {p} (a run directory holds metrics.jsonl)")
        runs += [r for r in found if r not in runs]
    return runs


def read_curve(run: Path) -> list[dict[str, Any]]:
    """The rows of ``run/metrics.jsonl`` (a torn or damaged line is skipped; ``fedlight verify`` names it)."""
    from fedlight.run.files import read_rows

    return read_rows(run / "metrics.jsonl")[0]


def read_summary(run: Path) -> dict[str, Any] | None:
    """``run/summary.json`` (``None``: absent or damaged, as for a run that has not finished). A run whose
    ``config.yaml`` carries its digest wrote a sealed summary: one edited or replaced is damaged."""
    from fedlight.run import side_files

    try:
        summary = json.loads((run / "summary.json").read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    config = run / "config.yaml"
    sealed = config.is_file() and side_files.TAG.encode() in config.read_bytes()
    if not isinstance(summary, dict) or side_files.damage(run / "summary.json", sealed) is not None:
        return None
    return summary


def revision(summary: dict[str, Any] | None) -> str | None:
    """The fedlight git revision a run's ``summary.json`` recorded (None: no summary, or not a git checkout)."""
    return ((summary or {}).get("versions") or {}).get("git_revision")


def finished(run: Path) -> bool:
    """A run is finished when ``summary.json`` reports all the rounds its ``config.yaml`` asked for (or that it
    stopped for good: ``diverged_at_round``)."""
    import yaml

    summary, cfg = read_summary(run), run / "config.yaml"
    if summary is None or not cfg.is_file():
        return False
    try:
        rounds = ((yaml.safe_load(cfg.read_text()) or {}).get("loop") or {}).get("rounds", 100)
    except (yaml.YAMLError, ValueError, AttributeError):
        return False
    return summary.get("rounds_completed", 0) >= rounds or summary.get("diverged_at_round") is not None


def target_fraction(metric: str) -> float:
    """``rounds_to_target:0.7`` (or ``:70``) → 0.7, for a fraction headline such as accuracy."""
    t = float(metric.split(":", 1)[1].rstrip("%"))
    return t / 100 if t > 1 else t


def last_count(metric: str) -> int:
    """``last_test_acc:10`` → 10."""
    try:
        return int(metric.split(":", 1)[1])
    except ValueError:
        return 0


def last_mean(curve: list[dict[str, Any]], key: str, k: int) -> float | None:
    """Mean of ``key`` (e.g. ``test_acc``) over the last ``k`` evaluations of a curve (fewer if the run evaluated
    fewer times).

    On strongly non-IID splits the accuracy after one round swings by several points from round to round (which
    10 clients were sampled last); this mean is the steadier "final accuracy"."""
    vals = [float(r[key]) for r in curve if r.get(key) is not None][-k:]
    return sum(vals) / len(vals) if vals else None


def last_test_acc(curve: list[dict[str, Any]], k: int) -> float | None:
    return last_mean(curve, "test_acc", k)


def curve_key(metric: str) -> str | None:
    """The ``metrics.jsonl`` key a metric reads (``final_test_mse`` → ``test_mse``); None for summary-only ones."""
    m = TASK_METRIC.match(metric)
    return None if m is None else (m.group(2) or m.group(3))


def check_metric(metric: str) -> None:
    if metric.startswith("rounds_to_target:"):
        check(target_fraction(metric) > 0, f"`{metric}`: the target must be a positive number")
    elif metric not in METRICS and (m := ROUND_METRIC.match(metric)) is not None:
        check((m.group(1) == "final") == (m.group(3) is None) and (m.group(3) is None or int(m.group(3)) > 0),
              f"`{metric}`: final_<key> takes no count; last_<key>:<k> and var_<key>:<k> need a positive k, "
              "e.g. var_train_loss:100")
    elif metric.startswith("last_"):
        m = TASK_METRIC.match(metric)
        check(m is not None and int(m.group(4)) > 0,
              f"`{metric}`: give a test metric and the number of last evaluations, e.g. last_test_acc:10")
    else:
        check(metric in METRICS or TASK_METRIC.match(metric) is not None,
              f"unknown metric {metric!r}; use {', '.join(METRICS)}, final_test_<m> / best_test_<m> (m: what the "
              "task reports, e.g. mse, perplexity, mcc), rounds_to_target:<t>, last_test_<m>:<k>, or "
              "final_/last_/var_ of a per-round key (var_train_loss:100, final_server/momentum_variance)")


def metric_value(run: Path, metric: str, strict: bool = True) -> float | None:
    """``metric`` of a finished run: accuracies, F1 and MCC in %; rounds to a target of the run's headline metric
    from the per-round curve (None: not reached); the rest from ``summary.json`` (or the curve). A per-round key the
    run does not log is an unknown metric, or with ``strict=False`` None (a table whose cells differ, e.g. ε of its
    private cells: `fedlight reproduce` then checks that some run of the table logs it)."""
    from fedlight.run.files import rounds_to_target

    check_metric(metric)
    summary = read_summary(run) or {}
    if metric.startswith("rounds_to_target:"):
        head = summary.get("headline") or {"metric": "test_acc", "higher_is_better": True}
        t = target_fraction(metric) if is_fraction(head["metric"]) else float(metric.split(":", 1)[1])
        return rounds_to_target(read_curve(run), t, head["metric"], head["higher_is_better"])
    key = curve_key(metric)
    v = summary.get(metric)
    if v is None and key is None and (m := ROUND_METRIC.match(metric)) is not None:
        return round_value(read_curve(run), m.group(1), m.group(2), int(m.group(3) or 1), strict)
    if v is None and key is not None:
        v = from_curve(read_curve(run), metric, key, summary)
    return None if v is None else (100 * v if key is not None and is_fraction(key) else v)


def round_value(curve: list[dict[str, Any]], kind: str, key: str, k: int, strict: bool = True) -> float | None:
    """``final``/``last``/``var`` of a per-round key over its last ``k`` finite values (None: the run has none)."""
    check(not strict or not curve or any(key in r for r in curve), f"unknown metric `{kind}_{key}`: no round of the "
          f"run reports `{key}` (its metrics.jsonl has {', '.join(sorted({x for r in curve[-1:] for x in r}))})")
    vals = [float(r[key]) for r in curve if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])][-k:]
    if not vals:
        return None
    return vals[-1] if kind == "final" else statistics.fmean(vals) if kind == "last" else statistics.pvariance(vals)


def from_curve(curve: list[dict[str, Any]], metric: str, key: str, summary: dict[str, Any]) -> float | None:
    if metric.startswith("last_"):
        return last_mean(curve, key, last_count(metric))
    vals = [float(r[key]) for r in curve if r.get(key) is not None]
    if not vals:
        return None
    if metric.startswith("final_"):
        return vals[-1]
    return max(vals) if _higher_is_better(summary, key) else min(vals)


def _higher_is_better(summary: dict[str, Any], key: str) -> bool:
    """``key``'s direction as the run's task recorded it in ``summary.json`` (``metric_directions``; the headline's
    also under ``headline``); refused when the run did not record it."""
    directions = summary.get("metric_directions") or {}
    head = summary.get("headline") or {}
    if key not in directions and head.get("metric") == key:
        return bool(head["higher_is_better"])
    check(key in directions, f"best_{key}: the run's summary.json does not record whether higher {key} is better "
          "(its task did not report it); use final_ or last_ of it")
    return bool(directions[key])


def metric_label(metric: str) -> str:
    from fedlight.run.files import metric_name

    if metric.startswith("rounds_to_target:"):
        return f"rounds to {metric.split(':', 1)[1]} (headline test metric)"
    key = curve_key(metric)
    if metric not in METRICS and (m := ROUND_METRIC.match(metric)) is not None:
        kind, name, k = m.groups()
        return {"final": f"final {name}", "last": f"mean {name} over the last {k} rounds",
                "var": f"variance of {name} over the last {k} rounds"}[kind]
    if key is None:
        return {"seconds_per_round": "seconds per round", "final_train_loss": "final train loss"}[metric]
    name = {"acc": "accuracy", "mcc": "MCC (Matthews correlation)", "f1": "F1"}.get(
        metric_name(key), metric_name(key).replace("_", " "))
    unit = " (%)" if is_fraction(key) else ""
    if metric.startswith("last_"):
        return f"mean test {name} over the last {last_count(metric)} evaluations{unit}"
    return f"{metric.split('_', 1)[0]} test {name}{unit}"


def stats(metric: str, vals: list) -> dict[str, Any]:
    """Mean ± sample std over seeds and its text; ``vals`` holds a value per seed, None (target not reached)
    or "missing" (the seed's run is not finished)."""
    done = [v for v in vals if v != "missing"]
    got = [float(v) for v in done if v is not None]
    mean = statistics.fmean(got) if got else None
    std = statistics.stdev(got) if len(got) > 1 else None
    digits = {"seconds_per_round": 3, "final_train_loss": 4}.get(metric, 2)
    if metric.startswith("rounds"):
        digits = 0 if mean is None or mean == int(mean) else 1
    elif metric not in METRICS and ROUND_METRIC.match(metric) and got:  # 3 significant digits of the smallest
        digits = max(2, 2 - math.floor(math.log10(min(abs(v) for v in got) or 1.0)))
    none = "not reached" if metric.startswith("rounds") else "—"  # e.g. ε of a non-private cell
    text = "not run" if not done else none if not got else \
        f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")
    if got and len(got) < len(done):
        text += f" ({len(got)}/{len(done)} reached)"
    if done and len(done) < len(vals):
        text += f" [{len(done)}/{len(vals)} seeds]"
    return {"mean": mean, "std": std, "n": len(got), "text": text, "digits": digits}


def hardware(runs: list[Path]) -> str:
    """CPU model and core count of this machine; the GPU names the runs' summaries recorded."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = sorted({g for r in runs if (g := ((read_summary(r) or {}).get("versions") or {}).get("cuda_device"))})
    return f"CPU {cpu} ({os.cpu_count()} cores); GPU {', '.join(gpus) if gpus else 'none'}"


def headline(run: Path) -> tuple[str, bool]:
    """A run's headline test metric and its direction (from ``summary.json``; runs before tasks: accuracy)."""
    h = (read_summary(run) or {}).get("headline") or {}
    return h.get("metric", "test_acc"), h.get("higher_is_better", True)


def _algorithm(run: Path) -> str:
    cfg = run / "config.yaml"
    if not cfg.is_file():
        return "?"
    import yaml

    algo = (yaml.safe_load(cfg.read_text()) or {}).get("algorithm") or {}
    return str(algo.get("class_path", "FedAvg")).rsplit(".", 1)[-1] if isinstance(algo, dict) else str(algo)


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def run_rows(runs: list[Path]) -> list[dict[str, Any]]:
    """One comparison row per run (unfinished runs report their last completed round)."""
    common = Path(os.path.commonpath([r.resolve() for r in runs]))
    rows = []
    for run in runs:
        s, curve = read_summary(run), read_curve(run)
        label = str(run.resolve().relative_to(common)) if len(runs) > 1 else run.name
        key, higher = headline(run)
        head = {"headline": {"metric": key, "higher_is_better": higher}}  # an unfinished run's best: its direction
        rows.append({
            "run": label, "algorithm": _algorithm(run), "finished": s is not None,
            "rounds": s["rounds_completed"] if s else (curve[-1]["round"] if curve else 0), "metric": key,
            f"final_{key}": s.get(f"final_{key}") if s else from_curve(curve, f"final_{key}", key, head),
            f"best_{key}": s.get(f"best_{key}") if s else from_curve(curve, f"best_{key}", key, head),
            "best_round": s["best_round"] if s else None,
            "final_train_loss": s["final_train_loss"] if s else (curve[-1].get("train_loss") if curve else None),
            "seconds_per_round": s["seconds_per_round"] if s else None,
            "git_revision": revision(s), "path": str(run),
        })
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per run; the metric columns are the first run's headline (accuracy, MSE, perplexity, ...)."""
    key = rows[0]["metric"] if rows else "test_acc"
    scale, fmt = (100, ".2f") if is_fraction(key) else (1, ".4g")

    def val(v):
        return _fmt(None if v is None else scale * v, fmt)

    name = metric_label(f"final_{key}").removeprefix("final test ")
    head = (f"| run | algorithm | rounds | final {name} | best {name} (round) | final train loss | s / round |\n"
            "|---|---|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {r['run']}{'' if r['finished'] else ' (unfinished)'} | {r['algorithm']} | {r['rounds']} | "
        f"{val(r.get(f'final_{key}'))} | {val(r.get(f'best_{key}'))} ({_fmt(r['best_round'], 'd')}) | "
        f"{_fmt(r['final_train_loss'], '.4f')} | {_fmt(r['seconds_per_round'], '.3f')} |\n" for r in rows)


def csv_text(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=list(dict.fromkeys(k for r in rows for k in r)), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return out.getvalue()
