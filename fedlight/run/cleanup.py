"""``--overwrite true``: remove what fedlight wrote in a run directory, and only that.

fedlight's files are known by name: ``config.yaml``, ``metrics.jsonl``, ``summary.json``, ``final_model.pt``,
``trackers.json``, ``checkpoints/{last,prev}.ckpt``, TensorBoard's ``tb/**/events.out.tfevents.*``, the CSV
tracker's ``csv/**/{metrics.csv,hparams.yaml}``, the W&B tracker's folder ``wandb/``, the client states
``client_state/rank<r>/c*-*-*.{bin,tmp}`` and the temporary ``.<name>.*.tmp`` of a killed write beside any of them.
A folder left empty is removed; any other file stays, and is named.
"""

from __future__ import annotations

import sys
from pathlib import Path

TOP = ("config.yaml", "metrics.jsonl", "summary.json", "final_model.pt", "trackers.json")
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
