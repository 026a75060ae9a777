"""Run records: atomic files, metrics.jsonl, summary.json, checkpoints, versions.

A crash or kill never leaves a torn file behind: everything is written to a temporary file in the
same directory and renamed over the target.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import platform
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedlight.errors import ConfigError

CHECKPOINT_FORMAT = 1

FAULT_HOOKS: list = []
"""Called before a fault-injection kill (a run record drains its background writes: the kill then falls exactly at
the named point, with earlier checkpoints durable)."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def fault(point: str, round: int) -> None:
    """Fault injection for the kill-safety tests: ``FEDLIGHT_FAULT=<point>@<round>[:<action>]``.

    Points: ``train`` (after the round's first client), ``eval`` (inside evaluation), ``ckpt`` (checkpoint written
    to its temporary file, not yet renamed), ``metrics`` (checkpoint renamed, metrics row not yet appended).
    Actions: ``kill`` (the default: SIGKILL the process there), ``enospc`` (the write fails there as on a full disk),
    ``pause`` (wait there once, up to 60 s, until a stop signal arrives, after creating the file named by
    ``FEDLIGHT_FAULT_READY``: a signal test then knows where the run is).
    """
    spec = os.environ.get("FEDLIGHT_FAULT")
    where, _, action = (spec or "").partition(":")
    if where != f"{point}@{round}":
        return
    for hook in list(FAULT_HOOKS):  # earlier checkpoints and metrics lines are durable first
        hook()
    if action == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device")
    if action == "pause":
        _pause()
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _pause() -> None:
    import torch.distributed as dist

    from fedlight.run import stops

    if os.environ.pop("FEDLIGHT_FAULT", None) is None or (dist.is_initialized() and dist.get_rank() != 0):
        return  # once, and on global rank 0 only (the others wait for it in the round's all-reduce)
    if os.environ.get("FEDLIGHT_FAULT_READY"):
        Path(os.environ["FEDLIGHT_FAULT_READY"]).touch()
    deadline = time.monotonic() + 60
    while not stops.requested() and time.monotonic() < deadline:
        time.sleep(0.02)


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def atomic_torch_save(obj: Any, path: Path, before_replace=None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a fedlight checkpoint safely (``weights_only=True``); a clear error for missing or corrupt files."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"`resume` checkpoint not found: {path}. Use `--resume auto` or point it at an existing "
                          "checkpoints/last.ckpt")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise ConfigError(f"`resume` checkpoint {path} is corrupt or not a fedlight checkpoint ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}). Delete it or point `resume` at another file") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"`resume` checkpoint {path} is not a fedlight checkpoint (format "
                          f"{ckpt.get('format') if isinstance(ckpt, dict) else type(ckpt).__name__})")
    return ckpt


def meta_differences(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """What makes a checkpoint's model and clients incompatible with this run (``key is A there and B here``)."""
    return [f"{key} is {there.get(key)!r} there and {here[key]!r} here"
            for key in ("algorithm", "model", "shapes", "num_clients", "seed") if there.get(key) != here[key]]


def cpu_copy(obj: Any) -> Any:
    """A private CPU copy of every tensor in ``obj`` (a checkpoint snapshot the next round cannot change)."""
    return _map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


def to_device(obj: Any, device) -> Any:
    """``obj`` with every tensor moved to ``device`` (dicts, lists, tuples and dataclasses such as
    :class:`~fedlight.rules.ClientResult`, recursively)."""
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
        rows = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and row.get("round", 0) <= rounds_done and all(
                        r["round"] != row["round"] for r in rows):
                    rows.append(row)
        self.rows = rows
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        append_line(self.path, json.dumps(row, allow_nan=False))


def append_line(path: Path, line: str) -> None:
    """Append one line and fsync it."""
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


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
