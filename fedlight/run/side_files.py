"""``config.yaml`` and ``summary.json`` carry the SHA-256 of their own content, so an edit or garbage is named.

``config.yaml`` ends with the comment line ``# fedlight-sha256: <hex>``, the digest of every byte before it (the
file stays plain YAML); ``summary.json`` holds the key ``fedlight_sha256``, the digest of the summary written
without it (``json.dumps(..., indent=2)``). :func:`damage` says why a file is not the one fedlight wrote. A run
written before these digests (its checkpoint's client store names files by absolute path, :func:`sealed`) verifies
as it did: those two files are only parsed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

TAG = "# fedlight-sha256: "
RUN_TAG = "# fedlight-run: "
KEY = "fedlight_sha256"
UNSEALED = "it carries no digest (edited, or not written by fedlight)"


def sealed(ckpt: dict[str, Any] | None) -> bool:
    """Whether the run of checkpoint ``ckpt`` seals its config.yaml and summary.json: every checkpoint since the
    digests names client-state files relative to the run directory (``store.paths``); ``None`` (no intact
    checkpoint): assumed."""
    return ckpt is None or (ckpt.get("store") or {}).get("paths") == "relative"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def seal_config(text: str, run_id: str | None = None) -> str:
    """``config.yaml``'s text with the run's identity (a comment line) and its digest line."""
    text = text if text.endswith("\n") or not text else text + "\n"
    text += f"{RUN_TAG}{run_id}\n" if run_id else ""
    return f"{text}{TAG}{_sha(text)}\n"


def run_id(path: Path) -> str | None:
    """The run identity ``config.yaml`` or ``summary.json`` at ``path`` records (``None``: none, or unreadable)."""
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            return json.loads(text).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return next((line[len(RUN_TAG):].strip() for line in text.splitlines() if line.startswith(RUN_TAG)), None)


def seal_summary(summary: dict[str, Any]) -> str:
    """``summary.json``'s text (strict JSON) with its digest."""
    body = {k: v for k, v in summary.items() if k != KEY}
    return json.dumps({**body, KEY: _sha(json.dumps(body, indent=2, allow_nan=False))}, indent=2,
                      allow_nan=False) + "\n"


def damage(path: Path, sealed: bool = True) -> str | None:
    """Why ``config.yaml`` or ``summary.json`` at ``path`` is not what fedlight wrote (``None``: it is, or it is
    absent). ``sealed=False`` (a run written before the digests): only parsed."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        return "not UTF-8"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if path.suffix == ".json":
        try:
            value = json.loads(text)
        except ValueError as e:
            return f"not JSON ({str(e).splitlines()[0]})"
        if not isinstance(value, dict):
            return "not a summary (a JSON object)"
        if KEY not in value:
            return UNSEALED if sealed else None
        body = {k: v for k, v in value.items() if k != KEY}
        ok = value[KEY] == _sha(json.dumps(body, indent=2, allow_nan=False))
        return None if ok else "its content differs from the one written (SHA-256 mismatch)"
    head, tag, digest = text.rpartition(TAG)
    if not tag:
        return _yaml_damage(text) or (UNSEALED if sealed else None)
    if "\n" in digest.rstrip("\n") or digest.strip() != _sha(head):
        return "its content differs from the one written (SHA-256 mismatch)"
    return None


def _yaml_damage(text: str) -> str | None:
    import yaml

    try:
        yaml.safe_load(text)
    except yaml.YAMLError as e:
        return f"not YAML ({str(e).splitlines()[0]})"
    return None
