"""Run summaries: rounds to a target, seconds per round, the final and best metrics, versions — what
``summary.json`` holds and what ``fedlight report`` and ``reproduce`` read back."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def reached(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def rounds_to_target(rows: list[dict[str, Any]], target: float, key: str = "test_acc",
                     higher_is_better: bool = True) -> int | None:
    """First round whose ``key`` reaches ``target`` (at least it, or at most it for a lower-is-better metric;
    rounds are 1-based counts of completed rounds)."""
    for r in rows:
        if r.get(key) is not None and reached(r[key], target, higher_is_better):
            return int(r["round"])
    return None


ROUND_EXTRAS = ("eval_time_s", "checkpoint_time_s")
"""What a user waits for per round besides training: evaluation, and the checkpoint snapshot on the critical path."""


def seconds_per_round(rows: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """The one definition of seconds per round, in two labelled parts, means over the *steady* rounds of
    ``rows``: *training* (``round_time_s``: local training and aggregation) and *with evaluation* (training +
    ``eval_time_s`` + ``checkpoint_time_s``: what a user waits for per round). Steady: every round but the first
    one each process ran (``warm_up`` in its row: it carries compilation, cuDNN autotuning and allocator warm-up,
    26 s against 1.6 s for a compiled ResNet-18 round on an H100), unless no other round is there. The console
    line and ``summary.json`` both use it; ``summary.json`` gives the warm-up rounds apart (:func:`warm_up_s`)."""
    timed = [r for r in rows if "round_time_s" in r]
    timed = [r for r in timed if not r.get("warm_up")] or timed
    if not timed:
        return None, None
    train = sum(r["round_time_s"] for r in timed) / len(timed)
    extra = sum(float(r.get(k) or 0.0) for r in timed for k in ROUND_EXTRAS) / len(timed)
    return train, train + extra


def warm_up_s(rows: list[dict[str, Any]]) -> float | None:
    """Mean training seconds of the warm-up rounds (the first round of each process), left out of
    :func:`seconds_per_round`."""
    warm = [r["round_time_s"] for r in rows if r.get("warm_up") and "round_time_s" in r]
    return sum(warm) / len(warm) if warm else None


def summarize(rows: list[dict[str, Any]], targets: list[float], totals: dict[str, Any],
              headline: tuple[str, bool] = ("test_acc", True)) -> dict[str, Any]:
    """The run's summary: final and best of the headline metric ``(key, higher_is_better)``, the final value of
    every other test metric, rounds to each target, seconds per round, totals, versions."""
    key, higher = headline
    evals = [r for r in rows if r.get(key) is not None]
    pick = max if higher else min
    best = pick(evals, key=lambda r: r[key]) if evals else None
    last = evals[-1] if evals else {}
    train_s, with_eval_s = seconds_per_round(rows)
    return {
        "headline": {"metric": key, "higher_is_better": higher},
        f"final_{key}": last.get(key),
        **{f"final_{k}": v for k, v in last.items() if k.startswith("test_") and k != key},
        f"best_{key}": best[key] if best else None,
        "best_round": best["round"] if best else None,
        "rounds_completed": rows[-1]["round"] if rows else 0,
        "rounds_to_target": {str(t): rounds_to_target(rows, t, key, higher) for t in targets},
        "final_train_loss": rows[-1].get("train_loss") if rows else None,
        "seconds_per_round": train_s,
        "seconds_per_round_with_eval": with_eval_s,
        "warm_up_round_s": warm_up_s(rows),
        **totals,
        "versions": versions(),
    }


def metric_name(key: str) -> str:
    """``final_test_acc`` / ``best_test_acc`` / ``test_acc`` → ``acc``."""
    return key.removeprefix("final_").removeprefix("best_").removeprefix("last_").removeprefix("test_")


def is_fraction(key: str) -> bool:
    """Metrics in [0, 1] that papers print as percentages: accuracies, F1, Matthews correlation."""
    name = metric_name(key)
    return name.endswith("acc") or name in ("accuracy", "f1", "mcc")


def format_metric(key: str, value: float | None) -> str:
    """A metric for people: accuracies, F1 and MCC as percentages, everything else to 4 significant digits."""
    if value is None:
        return "-"
    return f"{100 * value:.2f}%" if is_fraction(key) else f"{value:.4g}"


def git_revision() -> str | None:
    """The commit of the fedlight checkout this runs from; None for an installed wheel (whose folder may sit inside
    some other repository, e.g. a project's .venv)."""
    if not (Path(__file__).resolve().parents[2] / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, Any]:
    import lightning

    import fedlight

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "fedlight": fedlight.__version__,
        "git_revision": git_revision(),
        "platform": platform.platform(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
