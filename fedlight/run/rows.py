"""The rows of ``metrics.jsonl``: strict JSON, and the chain that binds each row to its run and to the rows before it.

Every row a run writes carries ``"chain"``: the SHA-256 of (the run's identity, the previous row's ``chain`` — ``""``
for the first —, the row's other keys as canonical JSON). A row edited after it was written, a row of another run, a
row dropped or moved breaks the chain from there on, so ``fedlight verify`` and ``--resume`` find it; the checkpoint
carries its round's row with its digest, which binds the chain's end to the sealed checkpoint. Rows written before the
chain (no ``"chain"`` key) are read as before and said to be unsealed; a run resumed from such rows chains the rows it
adds, starting afresh.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

CHAIN = "chain"
"""The key of a row's chain digest."""


def strict(obj: Any) -> Any:
    """``obj`` with every non-finite float (also inside dicts and lists) replaced by ``None``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [strict(v) for v in obj]
    return obj


def strict_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every non-finite float (also inside lists, e.g. ``clients``) replaced by ``null``; the keys
    holding one are listed under ``"nonfinite"``."""
    bad = [k for k, v in row.items() if strict(v) != v or (isinstance(v, float) and not math.isfinite(v))]
    if not bad:
        return row
    return {**{k: (strict(v) if k in bad else v) for k, v in row.items()}, "nonfinite": bad}


def dumps(row: dict[str, Any]) -> str:
    return json.dumps(strict_row(row), allow_nan=False)


def link(run_id: str, prev: str, row: dict[str, Any]) -> str:
    """The chain digest of ``row`` (its ``chain`` key left out) after a row whose digest is ``prev``, in run
    ``run_id``."""
    body = json.dumps({k: v for k, v in row.items() if k != CHAIN}, sort_keys=True, separators=(",", ":"),
                      allow_nan=False)
    return hashlib.sha256(f"{run_id}\n{prev}\n{body}".encode()).hexdigest()


def chained(row: dict[str, Any], run_id: str, prev: str) -> dict[str, Any]:
    """``row`` carrying its chain digest (see the module)."""
    return {**{k: v for k, v in row.items() if k != CHAIN}, CHAIN: link(run_id, prev, row)}


def unchained(rows: list[dict[str, Any]]) -> bool:
    """Whether ``rows`` were written before the chain (none carries a digest)."""
    return bool(rows) and not any(CHAIN in r for r in rows)


def chain_problem(rows: list[dict[str, Any]], run_id: str | None) -> str | None:
    """Why ``rows`` (of ``metrics.jsonl``, in file order) are not the rows run ``run_id`` wrote, one after the other
    (``None``: they are, or they were written before the chain). Rows before the first chained one are a run's from
    before the chain (it was resumed by a fedlight that chains)."""
    prev, started = "", False
    for r in rows:
        digest = r.get(CHAIN)
        if digest is None:
            if started:
                return f"its row of round {r['round']} lacks its chain digest (the rows before it carry one)"
            continue
        started = True
        if digest != link(run_id or "", prev, r):
            return (f"its row of round {r['round']} is not the row this run wrote there (its chain digest does not "
                    "match: edited after it was written, or another run's)")
        prev = digest
    return None
