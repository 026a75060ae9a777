"""``--overwrite true``: remove what fedlight wrote in a run directory, and only that.

fedlight's files are known by name: ``config.yaml``, ``metrics.jsonl``, ``summary.json``, ``final_model.pt``,
``trackers.json``, ``checkpoints/{last,prev}.ckpt``, TensorBoard's ``tb/**/events.out.tfevents.*``, the CSV
tracker's ``csv/**/{metrics.csv,hparams.yaml}``, the W&B tracker's folder ``wandb/``, the client states
``client_state/rank<r>/c*-*-*.{bin,tmp}`` and the temporary ``.<name>.*.tmp`` of a killed write beside any of them.
A folder left empty is removed; any other file stays, and is named. A file of one of those names that fedlight did
not write (:func:`foreign`: a ``config.yaml`` without fedlight's digest line or recipe keys, a ``summary.json``
without its digest, a ``metrics.jsonl`` of rounds that neither sits beside fedlight's ``config.yaml`` nor holds the
row an intact checkpoint there carries, ...) is never touched: the run is refused before it starts, naming the file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedlight.run import side_files

TOP = ("config.yaml", "metrics.jsonl", "summary.json", "final_model.pt", "final_model.ckpt", "trackers.json")
FOLDERS = ("checkpoints", "tb", "client_state", "csv", "wandb")


def fedlight_files(out: Path) -> list[Path]:
    """The files of ``out`` that fedlight wrote (by name), deepest first."""
    found = [out / n for n in TOP if (out / n).is_file()]
    found += [p for n in TOP for p in out.glob(f".{n}.*.tmp")]
    for name in ("last.ckpt", "prev.ckpt"):
        found += [p for p in (out / "checkpoints" / name, *(out / "checkpoints").glob(f".{name}.*.tmp")) if p.is_file()]
    found += [p for p in (out / "tb").rglob("events.out.tfevents.*") if p.is_file()]
    found += [p for n in ("metrics.csv", "hparams.yaml") for p in (out / "csv").rglob(n) if p.is_file()]
    found += [p for p in (out / "wandb").rglob("*") if p.is_file() or p.is_symlink()]  # the tracker's own folder
    for pattern in ("rank*/c*-*-*.bin", "rank*/c*-*-*.tmp"):
        found += [p for p in (out / "client_state").glob(pattern) if p.is_file()]
    return found


def foreign(out: Path) -> list[str]:
    """``"<file> (why)"`` for each top-level file of ``out`` named like one of fedlight's that fedlight did not write:
    its content carries neither fedlight's seal nor the shape of a file it wrote before the seals."""
    config = out / "config.yaml"
    ours_config = config.is_file() and _why(config) is None
    found = []
    for name in TOP:
        path = out / name
        why = _why(path, ours_config) if path.is_file() else None
        if why is not None:
            found.append(f"{name} ({why})")
    return found


def _why(path: Path, ours_config: bool = False) -> str | None:
    """Why ``path`` is not a file fedlight wrote (``None``: it is)."""
    from fedlight.run.atomic import seal_of

    try:
        if path.name.startswith("final_model."):  # sealed; one from before the seals only beside fedlight's config.yaml
            return None if seal_of(path) or ours_config else "it carries no fedlight seal"
        text = path.read_text(encoding="utf-8")
        if path.name == "config.yaml":
            import yaml

            value = yaml.safe_load(text)
            ours = side_files.TAG in text or isinstance(value, dict) and {"model", "data", "loop"} <= value.keys()
        elif path.name == "metrics.jsonl":  # a round's row beside fedlight's config.yaml or bound to a checkpoint
            first = json.loads(text.splitlines()[0]) if text.strip() else {"round": 0}
            ours = not text.strip() or isinstance(first.get("round"), int) and (ours_config or _bound(path))
        elif path.name == "summary.json":
            ours = bool({side_files.KEY, "rounds_completed"} & json.loads(text).keys())
        else:  # trackers.json: {name: {"id", "logged"}}
            ours = all(isinstance(v, dict) and "id" in v for v in json.loads(text).values())
    except Exception:  # noqa: BLE001 - unreadable, not UTF-8, not YAML/JSON, not a mapping: not fedlight's
        ours = False
    return None if ours else "its content is not what fedlight writes"


def _bound(metrics: Path) -> bool:
    """Whether an intact checkpoint beside ``metrics`` carries the row that file holds for the checkpoint's round."""
    from fedlight.run.atomic import load_checkpoint
    from fedlight.run.files import read_rows, row_disagrees

    rows = read_rows(metrics)[0]
    for name in ("last.ckpt", "prev.ckpt"):
        try:
            ckpt = load_checkpoint(metrics.parent / "checkpoints" / name)
        except Exception:  # noqa: BLE001 - missing, damaged or foreign: it proves nothing
            continue
        last = json.loads(ckpt.get("last_row") or "{}").get("round")
        if any(r["round"] == last for r in rows) and row_disagrees(rows, ckpt) is None:
            return True
    return False


def clear(out: Path) -> list[Path]:
    """Remove fedlight's files from ``out`` and the folders they leave empty; returns the files left in fedlight's
    folders (another program's), after saying so."""
    for p in fedlight_files(out):
        p.unlink(missing_ok=True)
    left: list[Path] = []
    for name in FOLDERS:
        folder = out / name
        if not folder.is_dir():
            continue
        for d in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            if not any(d.iterdir()):
                d.rmdir()
        if not any(folder.iterdir()):
            folder.rmdir()
        else:
            left += sorted(p for p in folder.rglob("*") if not p.is_dir())
    if left:
        names = ", ".join(str(p.relative_to(out)) for p in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5
                                                                          else "")
        print(f"fedlight: note: `--overwrite` removed fedlight's files from {out} and left {len(left)} it did not "
              f"write: {names}", file=sys.stderr, flush=True)
    return left
