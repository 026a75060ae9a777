"""Run records: ``metrics.jsonl`` (reading it back, damaged or not), checkpoint compatibility, tensor copies.

Atomic writes, sealed checkpoints and their loading are in :mod:`fedlight.run.atomic`, fault injection in
:mod:`fedlight.run.faults`, summaries in :mod:`fedlight.run.summary`; their names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from fedlight.run.atomic import (  # noqa: F401 - re-exported
    CHECKPOINT_FORMAT,
    DamagedFile,
    append_line,
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_text,
    check_sealed,
    load_checkpoint,
    remove_leftovers,
)
from fedlight.run.faults import fault  # noqa: F401 - re-exported
from fedlight.run.summary import (  # noqa: F401 - re-exported
    ROUND_EXTRAS,
    format_metric,
    git_revision,
    is_fraction,
    metric_name,
    reached,
    rounds_to_target,
    seconds_per_round,
    summarize,
    versions,
    warm_up_s,
)


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def meta_differences(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """What makes a checkpoint's model and clients incompatible with this run (``key is A there and B here``)."""
    return [f"{key} is {there.get(key)!r} there and {here[key]!r} here"
            for key in ("algorithm", "model", "shapes", "num_clients", "seed") if there.get(key) != here[key]]


def cpu_copy(obj: Any) -> Any:
    """A private CPU copy of every tensor in ``obj`` (a checkpoint snapshot the next round cannot change)."""
    return _map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


def to_device(obj: Any, device) -> Any:
    """``obj`` with every tensor moved to ``device`` (dicts, lists, tuples and dataclasses such as
    :class:`~fedlight.core.rules.ClientResult`, recursively)."""
    return _map_tensors(obj, lambda t: t.to(device))


def _map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


class MetricsLog:
    """``metrics.jsonl``: one JSON object per completed round, appended and fsync'ed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def truncate_to(self, rounds_done: int) -> None:
        """Keep rows of rounds ≤ ``rounds_done`` (drops rounds written after the last checkpoint, and torn lines)."""
        rows, _ = read_rows(self.path)
        self.rows = [r for r in rows if r["round"] <= rounds_done]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        append_line(self.path, json.dumps(row, allow_nan=False))


def read_rows(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of ``metrics.jsonl`` (first row of each round, in file order) and what is wrong with the lines that
    are not rows (``line 4 is not UTF-8``, ``line 5 is cut off or not JSON``)."""
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    if not Path(path).is_file():
        return rows, problems
    for n, raw in enumerate(Path(path).read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            problems.append(f"line {n} is not UTF-8")
            continue
        except json.JSONDecodeError:
            problems.append(f"line {n} is cut off or not JSON")
            continue
        if not isinstance(row, dict) or not isinstance(row.get("round"), int):
            problems.append(f"line {n} is not a round's row")
        elif all(r["round"] != row["round"] for r in rows):
            rows.append(row)
    return rows, problems


def row_disagrees(rows: list[dict[str, Any]], ckpt: dict[str, Any] | None) -> str | None:
    """Why ``rows`` (of ``metrics.jsonl``) are not the rows of checkpoint ``ckpt``'s run: its row of the checkpoint's
    round is not the one the checkpoint carries (``None``: it is, or either lacks that row)."""
    mine = json.loads(ckpt["last_row"]) if ckpt and ckpt.get("last_row") else {}
    theirs = next((r for r in rows if r["round"] == mine.get("round")), None)
    differ = [k for k in mine if theirs is not None and mine[k] != theirs.get(k)]
    if not differ:
        return None
    return (f"its row of round {mine['round']} is not the one the checkpoint of that round carries "
            f"({', '.join(differ[:3])} differ{'s' if len(differ) == 1 else ''}): another run's")


def missing_rounds(rows: list[dict[str, Any]], rounds_done: int) -> list[int]:
    """Rounds 1..``rounds_done`` that have no row."""
    have = {r["round"] for r in rows}
    return [k for k in range(1, rounds_done + 1) if k not in have]


def check_metrics(path: Path, ckpt: dict[str, Any]) -> None:
    """Refuse to continue from ``ckpt`` (of this run directory) when ``metrics.jsonl`` is not the record of its
    rounds, as ``fedlight verify`` finds it: rows of those rounds missing that the checkpoint cannot restore (it
    carries the row of its own round), or rows that are another run's or were edited (the row the checkpoint carries,
    the chain of :mod:`fedlight.run.rows`). Rows after the checkpoint's round are recomputed, not checked."""
    from fedlight.run.rows import chain_problem

    rounds_done = int(ckpt["round"])
    restorable = json.loads(ckpt["last_row"]).get("round") if ckpt.get("last_row") else None
    rows, problems = read_rows(path)
    lost = [k for k in missing_rounds(rows, rounds_done) if k != restorable]
    if lost:
        why = f" ({'; '.join(problems[:3])})" if problems else ""
        plural = "s" if len(lost) > 1 else ""
        raise DamagedFile(f"{path} is damaged: the rows of round{plural} {round_ranges(lost)} are missing{why}, and "
                          f"the checkpoint (round {rounds_done}) cannot restore them. Put back a copy of the file, or "
                          "start over with `--overwrite true`")
    kept = [r for r in rows if r["round"] <= rounds_done]
    why = row_disagrees(kept, ckpt) or chain_problem(kept, ckpt.get("run_id"))
    if why:
        raise DamagedFile(f"{path} is damaged: {why}; the checkpoint (round {rounds_done}) restores only its own "
                          "round's row, so the run is not continued on it. Put back this run's copy of the file, or "
                          "start over with `--overwrite true`")


def round_ranges(rounds: list[int]) -> str:
    """``[4, 5, 6, 9]`` → ``4-6, 9``."""
    out: list[list[int]] = []
    for k in rounds:
        if out and out[-1][1] == k - 1:
            out[-1][1] = k
        else:
            out.append([k, k])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in out)
