"""``fedlight verify RUN_DIR``: a run directory either verifies or says which file is damaged.

Checkpoints (``checkpoints/last.ckpt``, ``checkpoints/prev.ckpt``) and ``final_model.pt`` against their seal (SHA-256,
:mod:`fedlight.run.atomic`), the per-client state files a checkpoint names against their size and CRC-32 (found in
this run directory, wherever it was written: :mod:`fedlight.run.client_files`), other client-state files against the
CRC-32 in their names, ``summary.json`` and ``config.yaml`` against their own SHA-256 (:mod:`fedlight.run.side_files`;
the summary's round count also against ``metrics.jsonl``) and against this run: the run identity they and the
checkpoints record agrees, and ``final_model.pt``'s seal is the one ``summary.json`` records (a file copied in from
another run is damaged here); a missing ``config.yaml``, or a finished run's missing ``summary.json``, is damaged, as
are, once ``summary.json`` reports finished rounds, a missing ``final_model.pt`` whose seal it records, a missing
``metrics.jsonl`` and both checkpoints missing; ``metrics.jsonl`` row by row (every round up to the last checkpoint or
the summary present, each once, the row of the newest checkpoint's round the one that checkpoint carries: another
run's file copied in is damaged; and each row chained to this run and the rows before it, :mod:`fedlight.run.rows`:
an edited row is damaged). Temporary files of a
killed write are listed (the next start removes them).
Exit status 0: every file verifies; 2: at least one is damaged (or the folder is not a run directory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError
from fedlight.run import client_files, side_files
from fedlight.run.atomic import check_sealed, seal_of
from fedlight.run.files import missing_rounds, read_rows, round_ranges, row_disagrees
from fedlight.run.rows import chain_problem, unchained

Finding = tuple[str, str, str]  # (ok | damaged | leftover, file relative to the run directory, detail)


def check_run(out: Path) -> list[Finding]:
    """What is intact and what is damaged in the run directory ``out``."""
    found: list[Finding] = []
    ids: dict[str, str | None] = {}
    ckpt = _checkpoints(out, found, ids)
    _unnamed_client_states(out, found, intact=ckpt is not None)
    for name in ("final_model.pt", "final_model.ckpt"):  # .ckpt: a LightningModule's, for load_from_checkpoint
        if (out / name).exists():
            damage = check_sealed(out / name)
            found.append(("damaged", name, damage) if damage else ("ok", name, ""))
    sealed = side_files.sealed(ckpt)  # a run from before the digests: parsed only
    for name in ("summary.json", "config.yaml"):
        if (out / name).exists():
            why = side_files.damage(out / name, sealed)
            found.append(("damaged", name, why) if why else ("ok", name, ""))
    _missing(out, found)
    summary = _summary(out, found)
    this = _bound(out, ids, summary, found)
    done = summary.get("rounds_completed")
    fallback = done if isinstance(done, int) else 0  # the sealed checkpoint says how many rounds, else the summary
    _metrics(out, int(ckpt["round"]) if ckpt is not None else fallback, ckpt, found, this)
    if isinstance(done, int) and ("ok", "metrics.jsonl") in {f[:2] for f in found}:
        last = max((r["round"] for r in read_rows(out / "metrics.jsonl")[0]), default=0)
        if last != done:
            _damage(found, "summary.json", f"it reports {done} rounds and metrics.jsonl {last}: not this run's summary")
    for tmp in sorted([*out.glob(".*.tmp"), *(out / "checkpoints").glob(".*.tmp")]):
        found.append(("leftover", str(tmp.relative_to(out)), "the temporary file of a killed write (removed at the "
                                                             "next start)"))
    return found


def _checkpoints(out: Path, found: list[Finding], ids: dict[str, str | None]) -> dict[str, Any] | None:
    """Check both checkpoints; returns the newest intact one (loaded), for the metrics and client-state checks."""
    from fedlight.run.atomic import load_checkpoint

    newest = None
    for name in ("last.ckpt", "prev.ckpt"):
        path = out / "checkpoints" / name
        if not path.exists():
            continue
        try:
            ckpt = load_checkpoint(path)
        except ConfigError as e:
            found.append(("damaged", f"checkpoints/{name}", str(e).split(" is damaged: ")[-1]))
            continue
        found.append(("ok", f"checkpoints/{name}", f"(round {ckpt['round']})"))
        ids[f"checkpoints/{name}"] = ckpt.get("run_id")
        newest = newest or ckpt
        for cid, e in client_files.named(ckpt):
            _client_state(out, cid, e, found)
    return newest


def _client_state(out: Path, cid: int, entry: dict[str, Any], found: list[Finding]) -> None:
    path = client_files.locate(out, entry["path"])  # inside the run directory, whatever the checkpoint's age
    rel = str(path.relative_to(out))
    if any(f[1] == rel for f in found):
        return
    why = client_files.damage(path, int(entry["nbytes"]), int(entry["crc"]))
    found.append(("damaged", rel, f"client {cid}'s state: {why}") if why else ("ok", rel, ""))


def _unnamed_client_states(out: Path, found: list[Finding], intact: bool) -> None:
    """Client-state files no intact checkpoint names, by the CRC-32 their names carry: damaged ones always, every
    one when no checkpoint is intact (so damaged checkpoints do not hide damaged client states)."""
    named = {f[1] for f in found}
    for path in sorted((out / "client_state").glob("rank*/c*.bin")):
        rel = str(path.relative_to(out))
        if rel in named:
            continue
        why = client_files.self_check(path)
        if why is not None:
            found.append(("damaged", rel, why))
        elif not intact and client_files.NAME.fullmatch(path.name):
            found.append(("ok", rel, "(by the CRC-32 in its name)"))


def _missing(out: Path, found: list[Finding]) -> None:
    """A run's ``config.yaml`` is never missing; a finished run's (it wrote ``final_model.pt``) ``summary.json``
    neither; nor, once ``summary.json`` says the run finished rounds, the ``final_model.pt`` whose seal it records,
    ``metrics.jsonl``, or the checkpoint of its last round (every run writes one)."""
    if not (out / "config.yaml").exists():
        found.append(("damaged", "config.yaml", "it is missing (every run writes it before round 1)"))
    if (out / "final_model.pt").exists() and not (out / "summary.json").exists():
        found.append(("damaged", "summary.json", "it is missing, though the run finished (it wrote final_model.pt)"))
    summary = _summary(out, found)
    done = summary.get("rounds_completed")
    if summary.get("final_model_sha256") and not (out / "final_model.pt").exists():
        found.append(("damaged", "final_model.pt", "it is missing, though summary.json records its seal"))
    if isinstance(done, int) and done > 0 and not (out / "metrics.jsonl").exists():
        found.append(("damaged", "metrics.jsonl", f"it is missing, though summary.json reports {done} rounds"))
    if isinstance(done, int) and done > 0 and not any((out / "checkpoints" / n).exists() for n in ("last.ckpt",
                                                                                                   "prev.ckpt")):
        found.append(("damaged", "checkpoints/last.ckpt", f"it is missing (and prev.ckpt), though summary.json "
                      f"reports {done} rounds: every run writes the checkpoint of its last round"))


def _bound(out: Path, ids: dict[str, str | None], summary: dict[str, Any], found: list[Finding]) -> str | None:
    """Each side file belongs to this run: the run identity that config.yaml, summary.json and the checkpoints
    record agrees (the newest intact checkpoint's wins, then config.yaml's), and final_model.pt is the one the summary
    names by its seal. A file without an identity (written before them) is not compared. Returns the run's
    identity (``None``: none recorded)."""
    ok = {f[1] for f in found if f[0] == "ok"}
    ids.update({n: side_files.run_id(out / n) for n in ("config.yaml", "summary.json") if n in ok})
    this = next((i for i in ids.values() if i), None)
    for name, other in ids.items():
        if other and other != this:
            _damage(found, name, f"it is another run's (run {other}; this run is {this})")
    sealed, theirs = summary.get("final_model_sha256"), summary.get("run_id") not in (None, this)
    if "final_model.pt" in ok and sealed and (seal_of(out / "final_model.pt") == sealed) == theirs:
        _damage(found, "final_model.pt", "it is another run's: its seal is "
                + ("the one the other run's summary.json records" if theirs else "not the one summary.json records"))
    return this


def _damage(found: list[Finding], name: str, why: str) -> None:
    found[[f[1] for f in found].index(name)] = ("damaged", name, why)


def _summary(out: Path, found: list[Finding]) -> dict[str, Any]:
    if ("ok", "summary.json") not in {f[:2] for f in found}:
        return {}
    return json.loads((out / "summary.json").read_text())


def _metrics(out: Path, rounds_done: int, ckpt: dict[str, Any] | None, found: list[Finding], run_id: str | None
             ) -> None:
    path = out / "metrics.jsonl"
    if not path.exists():
        return
    rows, problems = read_rows(path)
    restorable = json.loads(ckpt["last_row"])["round"] if ckpt and ckpt.get("last_row") else None
    lost = [k for k in missing_rounds(rows, rounds_done) if k != restorable]
    twice = _repeated(path)
    theirs = row_disagrees(rows, ckpt)
    broken = chain_problem(rows, run_id)
    if lost:
        why = f" ({'; '.join(problems[:3])})" if problems else ""
        rounds = f"round{'s' if len(lost) > 1 else ''} {round_ranges(lost)}"
        found.append(("damaged", "metrics.jsonl", f"the rows of {rounds} are missing{why}"))
    elif twice:
        found.append(("damaged", "metrics.jsonl", f"round{'s' if len(twice) > 1 else ''} {round_ranges(twice)} "
                      f"{'have' if len(twice) > 1 else 'has'} more than one row (a run writes one per round)"))
    elif theirs:
        found.append(("damaged", "metrics.jsonl", f"it is another run's: {theirs.rsplit(': ', 1)[0]}"))
    elif broken:
        found.append(("damaged", "metrics.jsonl", broken))
    else:
        old = "; written before rows were chained to their run: an edited row is not found" if unchained(rows) else ""
        found.append(("ok", "metrics.jsonl", f"({len(rows)} rounds{old})"))


def _repeated(path: Path) -> list[int]:
    """The rounds that have more than one row in ``metrics.jsonl``."""
    seen: dict[int, int] = {}
    for raw in path.read_bytes().split(b"\n"):
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(row, dict) and isinstance(row.get("round"), int):
            seen[row["round"]] = seen.get(row["round"], 0) + 1
    return sorted(k for k, n in seen.items() if n > 1)


def cmd_verify(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="fedlight verify", description="Check a run directory's files: checkpoints and "
                                "final model against their SHA-256 seal, client states, summary, config, metrics. "
                                "Exit status 0: every file verifies; 2: a file is damaged.")
    p.add_argument("run_dir")
    out = Path(p.parse_args(argv).run_dir)
    if not (out / "config.yaml").exists() and not (out / "checkpoints").is_dir():
        raise ConfigError(f"{out} is not a fedlight run directory (no config.yaml, no checkpoints/)")
    found = check_run(out)
    for status, name, detail in found:
        sep = ": " if status != "ok" else " "
        print(f"{status:<8} {name}{sep + detail if detail else ''}".rstrip())
    bad = sum(status == "damaged" for status, _, _ in found)
    print(f"{out}: every file verifies" if not bad else f"{out}: {bad} damaged file{'s' if bad > 1 else ''}")
    return 2 if bad else 0
