"""The per-client state files a checkpoint names (``client_state/rank<r>/c<id>-<token>-<n>-<crc>.bin``).

A checkpoint names each file by its path relative to the run directory, so a copied or moved run directory uses its
own files and no other (checkpoints written before that named them by absolute path: :func:`locate` maps those into
the run directory too, never outside it). Each entry also holds the file's size and CRC-32, and the file's name ends
in its CRC-32, so a file can be checked even when no intact checkpoint names it.

:func:`named_damage` checks every file a checkpoint names before round 1 of a resume (and ``fedlight verify``).
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path, PurePath
from typing import Any

NAME = re.compile(r"c(\d+)-[0-9a-f]+-\d+-([0-9a-f]{8})\.bin")
"""A client-state file's name: client id, writer token, sequence number, CRC-32 of its bytes."""


def locate(run_dir: Path, recorded: str) -> Path:
    """The file a checkpoint of ``run_dir`` names as ``recorded``: relative to the run directory; an absolute path
    (an older checkpoint) is taken from its ``client_state/`` component on, inside ``run_dir``."""
    p = PurePath(recorded)
    if not p.is_absolute():
        return Path(run_dir) / p
    parts = p.parts
    if "client_state" in parts:
        return Path(run_dir).joinpath(*parts[len(parts) - 1 - parts[::-1].index("client_state"):])
    return Path(run_dir) / p.name


def damage(path: Path, nbytes: int, crc: int) -> str | None:
    """Why the client-state file ``path`` is not the one written (``None``: it is)."""
    try:
        if not path.is_file():
            return "it is missing"
        if path.stat().st_size != nbytes:
            return f"it is truncated or grew ({path.stat().st_size} bytes, {nbytes} written)"
        if crc32(path) != crc:
            return "its bytes differ from the ones written (CRC-32 mismatch)"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    return None


def crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def named(ckpt: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """``(client id, entry)`` for every file the checkpoint ``ckpt`` names, by client id."""
    return sorted(((int(c), e) for c, e in ((ckpt.get("store") or {}).get("spilled") or {}).items()),
                  key=lambda item: item[0])


def named_damage(run_dir: Path, ckpt: dict[str, Any]) -> list[tuple[Path, int, str]]:
    """``(file, client id, why)`` for each file the checkpoint ``ckpt`` of ``run_dir`` names that is missing or
    damaged."""
    out = []
    for cid, e in named(ckpt):
        path = locate(run_dir, e["path"])
        why = damage(path, int(e["nbytes"]), int(e["crc"]))
        if why is not None:
            out.append((path, cid, why))
    return out


def self_check(path: Path) -> str | None:
    """Why a client-state file is damaged by the CRC-32 its name carries (``None``: intact, or a name without one)."""
    m = NAME.fullmatch(path.name)
    if m is None:
        return None
    try:
        ok = crc32(path) == int(m.group(2), 16)
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    return None if ok else f"client {m.group(1)}'s state differs from the one written (CRC-32 in its name)"

