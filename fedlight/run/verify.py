"""``fedlight verify RUN_DIR``: a run directory either verifies or says which file is damaged.

Checkpoints (``checkpoints/last.ckpt``, ``checkpoints/prev.ckpt``) and ``final_model.pt`` against their seal (SHA-256,
:mod:`fedlight.run.atomic`), the per-client state files a checkpoint names against their CRC, ``summary.json`` and
``config.yaml`` as JSON and YAML, ``metrics.jsonl`` row by row (every round up to the last checkpoint or the summary
present). Temporary files of a killed write are listed (the next start removes them). Exit status 0: every file
verifies; 2: at least one is damaged (or the folder is not a run directory).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError
from fedlight.run.atomic import check_sealed
from fedlight.run.files import missing_rounds, read_rows, round_ranges

Finding = tuple[str, str, str]  # (ok | damaged | leftover, file relative to the run directory, detail)


def check_run(out: Path) -> list[Finding]:
    """What is intact and what is damaged in the run directory ``out``."""
    found: list[Finding] = []
    ckpt = _checkpoints(out, found)
    if (out / "final_model.pt").exists():
        damage = check_sealed(out / "final_model.pt")
        found.append(("damaged", "final_model.pt", damage) if damage else ("ok", "final_model.pt", ""))
    summary = _text_file(out, "summary.json", json.loads, found)
    _text_file(out, "config.yaml", _yaml, found)
    done = summary.get("rounds_completed") if isinstance(summary, dict) else None
    _metrics(out, done if isinstance(done, int) else int((ckpt or {}).get("round", 0)), ckpt, found)
    for tmp in sorted([*out.glob(".*.tmp"), *(out / "checkpoints").glob(".*.tmp")]):
        found.append(("leftover", str(tmp.relative_to(out)), "the temporary file of a killed write (removed at the "
                                                             "next start)"))
    return found


def _checkpoints(out: Path, found: list[Finding]) -> dict[str, Any] | None:
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
        newest = newest or ckpt
        for cid, e in sorted((ckpt.get("store") or {}).get("spilled", {}).items()):
            _client_state(out, int(cid), e, found)
    return newest


def _client_state(out: Path, cid: int, entry: dict[str, Any], found: list[Finding]) -> None:
    path = Path(entry["path"])
    path = path if path.is_file() else out / "client_state" / path.parent.name / path.name
    rel = str(path.relative_to(out)) if path.is_relative_to(out) else str(path)
    if any(f[1] == rel for f in found):
        return
    if not path.is_file() or path.stat().st_size != entry["nbytes"]:
        found.append(("damaged", rel, f"client {cid}'s state is missing or truncated"))
    elif zlib.crc32(path.read_bytes()) != entry["crc"]:
        found.append(("damaged", rel, f"client {cid}'s state differs from the one written (CRC-32 mismatch)"))
    else:
        found.append(("ok", rel, ""))


def _text_file(out: Path, name: str, parse, found: list[Finding]) -> Any:
    path = out / name
    if not path.exists():
        return None
    try:
        value = parse(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        found.append(("damaged", name, "not UTF-8"))
        return None
    except ValueError as e:  # json.JSONDecodeError and yaml.YAMLError (wrapped) are ValueErrors
        found.append(("damaged", name, f"not {'JSON' if name.endswith('json') else 'YAML'} ({str(e).splitlines()[0]})"))
        return None
    found.append(("ok", name, ""))
    return value


def _yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def _metrics(out: Path, rounds_done: int, ckpt: dict[str, Any] | None, found: list[Finding]) -> None:
    path = out / "metrics.jsonl"
    if not path.exists():
        return
    rows, problems = read_rows(path)
    restorable = json.loads(ckpt["last_row"])["round"] if ckpt and ckpt.get("last_row") else None
    lost = [k for k in missing_rounds(rows, rounds_done) if k != restorable]
    if lost:
        why = f" ({'; '.join(problems[:3])})" if problems else ""
        rounds = f"round{'s' if len(lost) > 1 else ''} {round_ranges(lost)}"
        found.append(("damaged", "metrics.jsonl", f"the rows of {rounds} are missing{why}"))
    else:
        found.append(("ok", "metrics.jsonl", f"({len(rows)} rounds)"))


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
