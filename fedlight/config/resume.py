"""Where a run starts: the run directory it may use and the checkpoint a resume continues from.

``--resume auto`` finds ``checkpoints/last.ckpt`` (or says why it starts fresh, naming a sibling run of the same recipe
whose settings differ); a fresh run refuses a directory holding another run unless told to overwrite it, and reuses
one whose run finished no round. The checkpoint's compatibility is checked once, later, by the fit driver.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError
from fedlight.run import cleanup, side_files
from fedlight.run.directory import LOCK_NAME, RUN_FILES, check_out_dir, differences, load_resume
from fedlight.run.files import check_metrics, load_checkpoint


def start(out: Path, resume: str | None, overwrite: bool, defining: dict[str, Any], rounds: int | None = None):
    """The checkpoint a resume continues from (path and contents; ``None`` for a fresh run), after checking that
    ``out`` may be used, and whether to clear it (a failed start's directory is reused). ``rounds``: the run's
    rounds (a finished run told to ``overwrite`` starts over: its rows are not read)."""
    check_out_dir(out)
    ckpt_path, ckpt = load_resume(resolve_resume(resume, out, defining), resume == "auto", note)
    if ckpt is not None and ckpt_path.parent.parent.resolve() == out.resolve():
        done = rounds is not None and int(ckpt["round"]) >= rounds
        if not (done and overwrite):  # a finished run told to overwrite starts over (:func:`finished`): none of it read
            check_metrics(out / "metrics.jsonl", ckpt)  # never silently fewer rows, nor another run's or edited ones
    return ckpt_path, ckpt, check_existing(out, resume, overwrite)


REBUILT = ("summary.json", "final_model.pt")
"""Files a resumed finished run writes again from its checkpoint and rows (config.yaml: :func:`config_damaged`)."""


def check_finished(out: Path, ckpt_path: Path, ckpt: dict[str, Any]) -> list[str]:
    """A finished run resumed trains nothing, so it ends with every file verifying (as ``fedlight verify`` checks
    them) or does not start: a damaged summary.json or final_model.pt is written again from the checkpoint (said in a
    note; returned: the finishing pass writes them), any other damaged file is refused, named."""
    from fedlight.run.verify import check_run

    rebuilt = []
    for status, name, why in check_run(out):
        if status != "damaged" or name in ("config.yaml", "metrics.jsonl"):  # rewritten / checked by check_metrics
            continue
        if name not in REBUILT:
            raise ConfigError(f"{out / name} is damaged: {why}. The run is finished and its checkpoint {ckpt_path} "
                              "cannot rebuild that file: put back an intact copy, or delete it if it is a checkpoint "
                              f"or client state the run no longer needs (`fedlight verify {out}` lists every file)")
        note(f"{out / name} is damaged: {why}; written again from the checkpoint {ckpt_path} (round {ckpt['round']}, "
             "the run's last)")
        rebuilt.append(name)
    return rebuilt


class Finished(dict):
    """The ``summary.json`` of a run that a command found already finished (it trained nothing)."""


def finished(plan, overwrite: bool) -> Finished | None:
    """The summary of the run in ``plan.out`` when the checkpoint a resume found there is that run's, finished at
    ``loop.rounds`` with the same defining settings, its ``summary.json`` and ``final_model.pt`` written: one line says
    so, naming the folder and how to train anew. Told to ``overwrite``, a finished run starts over instead (``plan``
    then resumes nothing and clears the folder). ``None``: there is something to do (train, or finish)."""
    out, ckpt = plan.out, plan.ckpt
    if ckpt is None or plan.ckpt_path.parent.parent.resolve() != out.resolve() or int(ckpt["round"]) < plan.loop.rounds:
        return None
    if overwrite:
        plan.ckpt_path, plan.ckpt, plan.clear = None, None, True
        return None
    if int(ckpt["round"]) != plan.loop.rounds or differences(json.loads(ckpt.get("settings") or "{}"), plan.defining):
        return None  # another run's settings: refused with the differences, later
    if check_finished(out, plan.ckpt_path, ckpt):
        return None  # a damaged summary.json or final_model.pt: the finishing pass writes it again
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    ours = summary.get("run_id") in (None, ckpt.get("run_id"))
    if not ours or summary.get("rounds_completed") != plan.loop.rounds or not (out / "final_model.pt").is_file():
        return None  # stopped between its last checkpoint and its summary: finishing writes them
    sent = _json(out / "trackers.json")
    if any(not isinstance(sent.get(e["name"]), dict) or sent[e["name"]].get("logged", 0) < plan.loop.rounds
           for e in plan.trackers[1]):
        return None  # a tracker added (or one that missed rounds): the finishing pass sends it the rounds it lacks
    from fedlight.run.files import format_metric

    key = (summary.get("headline") or {}).get("metric", "test_acc")
    last = (summary.get("segments") or json.loads(ckpt.get("segments") or "[]"))[-1:] or [{}]
    changed = sorted(k for k, v in plan.execution.items() if k in last[0].get("settings", {})
                     and json.dumps(v, default=str) != json.dumps(last[0]["settings"][k], default=str)
                     and k not in ("resume", "overwrite", "out_dir"))
    why = f"; {', '.join(changed)} changed, execution-only (the same run, in the same folder)" if changed else ""
    if _launching():
        print(f"fedlight: {out} already holds this run, finished ({plan.loop.rounds} rounds, final "
              f"{key.replace('_', ' ')} {format_metric(key, summary.get(f'final_{key}'))}){why}: nothing trained. To "
              "train it anew pass `--overwrite true` or another `--out_dir`", file=sys.stderr, flush=True)
    return Finished(summary)


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def resolve_resume(resume: str | None, out: Path, defining: dict[str, Any] | None = None) -> Path | None:
    if resume is None:
        return None
    if resume == "auto":
        last = out / "checkpoints" / "last.ckpt"
        if last.exists() or last.with_name("prev.ckpt").exists():  # prev alone: killed between the two renames
            return last if last.exists() else last.with_name("prev.ckpt")
        note(f"`--resume auto` found no checkpoint in {out}: nothing to resume, starting a new run there"
              f"{_other_run(out, defining or {})}")
        return None
    return Path(resume)


def _other_run(out: Path, defining: dict[str, Any]) -> str:
    """``; ... <dir> is a run of the same recipe whose settings differ: ...`` for the newest resumable sibling
    ``<name>-<hash>`` of a default run directory (the hash differs when defining settings do), or ``""``."""
    m = re.fullmatch(r"(.+)-[0-9a-f]{8}", out.name)
    if m is None or not out.parent.is_dir():
        return ""
    ckpts = sorted((d / "checkpoints" / "last.ckpt" for d in out.parent.glob(f"{m.group(1)}-*") if d != out),
                   key=lambda p: p.stat().st_mtime if p.exists() else 0, reverse=True)
    for ckpt in (c for c in ckpts if c.exists()):
        try:
            there = json.loads(load_checkpoint(ckpt).get("settings") or "{}")
        except ConfigError:
            continue
        diffs = differences(there, defining)
        if diffs:
            return (f"; {ckpt.parent.parent} is a run of the same recipe whose settings differ ({'; '.join(diffs)}): "
                    "to continue it, rerun with its settings or pass `--out_dir` " + str(ckpt.parent.parent))
    return ""


def note(message: str) -> None:
    """One ``fedlight: note:`` line, from the launching process only (Fabric's launcher reruns ``fit`` per rank)."""
    if _launching():
        print(f"fedlight: note: {message}", file=sys.stderr, flush=True)


def _launching() -> bool:
    """Whether this is the launching process (not a rank that Fabric's launcher, ``torchrun`` or ``srun`` started)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def check_existing(out: Path, resume: str | None, overwrite: bool) -> bool | str:
    """A fresh run refuses a directory that holds another run unless told to overwrite it (cleared later, under the
    lock, by the run record). A directory whose run finished no round is not a run: it is reused (cleared too).
    Returns whether the directory is to be cleared (``"reuse"``: cleared, with a note once the lock is held)."""
    if not out.exists() or not any(p.name != LOCK_NAME for p in out.iterdir()):
        return overwrite
    theirs = cleanup.foreign(out)
    continued = resume is not None and any((out / "checkpoints" / n).exists() for n in ("last.ckpt", "prev.ckpt"))
    if theirs and not continued:  # a fresh run there would replace them, `--overwrite` delete them: never
        them = "it" if len(theirs) == 1 else "them"
        raise ConfigError(f"`out_dir` {out} holds {'a file' if len(theirs) == 1 else 'files'} named like fedlight's "
                          f"that fedlight did not write: {', '.join(theirs)}; move {them} away or choose another "
                          "`--out_dir`")
    if resume is not None:
        return overwrite
    if _no_round_finished(out):
        return "reuse"
    if not overwrite:
        raise ConfigError(f"`out_dir` {out} already holds a run; pass `--resume auto` to continue it, "
                          "`--overwrite true` to start over, or choose another `--out_dir`")
    if not any((out / f).exists() for f in ("config.yaml", "checkpoints/last.ckpt", "checkpoints/prev.ckpt")):
        held = ", ".join(sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME)[:6])
        raise ConfigError(f"`overwrite` refuses to clear {out}: it holds no config.yaml and no checkpoint of a "
                          f"fedlight run ({held}), so its files may be another program's; remove them yourself or "
                          "choose another `--out_dir`")
    return True


def _no_round_finished(out: Path) -> bool:
    """``out`` holds only fedlight run files, and no checkpoint, summary, final model or metrics row."""
    names = {p.name for p in out.iterdir()} - {LOCK_NAME}
    if not names <= set(RUN_FILES) or "config.yaml" not in names:
        return False
    if any((out / f).exists() for f in ("summary.json", "final_model.pt", "checkpoints/last.ckpt")):
        return False
    metrics = out / "metrics.jsonl"
    return not metrics.exists() or not metrics.read_text().strip()


def config_damaged(out: Path, ckpt: dict[str, Any]) -> bool:
    """Whether ``out/config.yaml`` is to be rewritten from this run's settings, which the checkpoint just confirmed:
    damaged or edited (saying so), or written before config files carried their digest."""
    why = side_files.damage(out / "config.yaml")
    if why == side_files.UNSEALED and not side_files.sealed(ckpt):  # written before the digests: sealed now
        note(f"{out / 'config.yaml'} was written by a fedlight that did not seal it (no digest line): rewritten "
             "from the checkpoint's settings (this run's, which the checkpoint confirmed), with its digest")
        return True
    if why is not None:
        note(f"{out / 'config.yaml'} is damaged: {why}; rewritten from the checkpoint's settings (this run's, which "
             "the checkpoint confirmed)")
    return why is not None
