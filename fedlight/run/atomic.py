"""Files that are whole or absent, and that prove their bytes.

* Every file of a run directory is written to a temporary ``.<name>.*.tmp`` beside it, fsync'ed and renamed over
  the target, so a crash or kill never leaves a torn file (:func:`remove_leftovers` deletes the temporary file a
  kill left behind, at the next start).
* Checkpoints and ``final_model.pt`` are *sealed*: :func:`atomic_torch_save` streams ``torch.save``'s zip through a
  SHA-256 and, once every byte is written, stores the digest as the zip's comment (``fedlight-sha256:<hex>``). The
  file stays a plain zip that ``torch.load`` reads; :func:`check_sealed` recomputes the digest and
  :func:`load_checkpoint` refuses a file whose bytes changed before any tensor of it is used.
* A failed write raises :class:`OSError` with the file's name (``torch.save`` on a full disk says ``unexpected
  pos``; here it says ``No space left on device``), which :func:`fedlight.run.stops.disk_guard` turns into one
  message and exit status 74.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError
from fedlight.run import faults

CHECKPOINT_FORMAT = 1
SEAL = b"fedlight-sha256:"
SEAL_LEN = len(SEAL) + 64  # the zip comment: tag + hex digest
EOCD = b"PK\x05\x06"  # end of a zip's central directory (22 bytes, the last 2 the comment length)


class DamagedFile(ConfigError):
    """A run file whose bytes are not what was written (or that is empty, truncated or unreadable)."""


# ------------------------------------------------------------------------------------------------ writing
def atomic_write_bytes(path: Path, data: bytes) -> None:
    def fill(fd: int) -> None:
        faults.on_write(path)
        _write_all(fd, data, Path(path))

    _atomic(Path(path), fill)


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once, at import (os.umask sets as it reads; the background writer must not race it)


def _atomic(path: Path, fill, before_replace=None, previous: Path | None = None) -> None:
    """``fill(fd)`` writes a temporary file beside ``path``; it is fsync'ed and renamed over ``path`` (after moving
    the file there to ``previous``, if given), or removed if anything fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide a run's files from the group the umask admits
        fill(fd)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        if before_replace is not None:
            before_replace()
        if previous is not None and path.exists():
            os.replace(path, previous)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def append_line(path: Path, line: str) -> None:
    """Append one line and fsync it."""
    faults.on_write(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _write_all(fd, (line + "\n").encode(), Path(path))
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data, path: Path) -> None:
    """``os.write`` until every byte is out; a failure is an :class:`OSError` naming ``path``."""
    view = memoryview(data).cast("B")
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


class _SealingSink:
    """The file object ``torch.save`` writes to: every byte goes to the file and through the digest."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path, self.size, self.sha = fd, path, 0, hashlib.sha256()
        self.error: OSError | None = None  # the first failed write (torch then fails again, with "unexpected pos")

    def write(self, data) -> int:
        try:
            if not self.size:
                faults.on_write(self.path)
            _write_all(self.fd, data, self.path)
        except OSError as e:
            self.error = self.error or e
            raise
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass

    def seal(self) -> None:
        """Replace the zip's empty comment by the digest of everything written before it."""
        if self.size < 22 or os.pread(self.fd, 4, self.size - 22) != EOCD:
            raise RuntimeError(f"{self.path}: torch.save did not write a zip (no end record); cannot seal it")
        tail = SEAL_LEN.to_bytes(2, "little") + SEAL + self.sha.hexdigest().encode()
        os.lseek(self.fd, self.size - 2, os.SEEK_SET)
        _write_all(self.fd, tail, self.path)


def atomic_torch_save(obj: Any, path: Path, before_replace=None, previous: Path | None = None) -> None:
    """``torch.save(obj)`` to ``path``, sealed, atomically. ``previous``: first move the file already at ``path``
    there (the previous good checkpoint is kept; both renames are atomic, so one of the two names always holds a
    complete checkpoint)."""
    import torch

    def fill(fd: int) -> None:
        sink = _SealingSink(fd, path)
        try:
            torch.save(obj, sink)
        except Exception:
            if sink.error is not None:
                raise sink.error from None
            raise
        sink.seal()

    path = Path(path)
    _atomic(path, fill, before_replace, previous)


def remove_leftovers(folder: Path) -> list[Path]:
    """Delete the temporary files (``.<name>.*.tmp``) a killed write left in ``folder``; returns them."""
    gone = []
    for tmp in Path(folder).glob(".*.tmp") if Path(folder).is_dir() else ():
        tmp.unlink(missing_ok=True)
        gone.append(tmp)
    return gone


# ------------------------------------------------------------------------------------------------ checking
def check_sealed(path: Path) -> str | None:
    """Why the sealed file ``path`` cannot be trusted (``None``: its bytes are the ones written). A file without a
    seal (written before fedlight sealed its files) is checked against its zip CRCs instead."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return "it is empty"
            f.seek(max(0, size - SEAL_LEN - 2))
            tail = f.read()
            if len(tail) < SEAL_LEN + 2 or tail[2:2 + len(SEAL)] != SEAL:
                return _check_zip(path)
            sha = hashlib.sha256()
            f.seek(0)
            left = size - SEAL_LEN - 2
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    return "it is truncated"
                sha.update(chunk)
                left -= len(chunk)
            sha.update(b"\0\0")
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if sha.hexdigest().encode() != tail[2 + len(SEAL):]:
        return "its bytes differ from the ones written (SHA-256 mismatch)"
    return None


def seal_of(path: Path) -> str | None:
    """The SHA-256 a sealed file's seal records (``None``: it has none)."""
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - SEAL_LEN))
        tail = f.read()
    return tail[len(SEAL):].decode() if tail.startswith(SEAL) else None


def _check_zip(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"it is truncated or not a checkpoint ({str(e) or type(e).__name__})"
    return None if bad is None else f"its record {bad} is damaged (zip CRC mismatch)"


def load_checkpoint(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a fedlight checkpoint safely: its seal verified first, then ``torch.load(weights_only=True)``; a
    missing, damaged or foreign file is one :class:`~fedlight.errors.ConfigError` naming it."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"`resume` checkpoint not found: {path}. Use `--resume auto` or point it at an existing "
                          "checkpoints/last.ckpt")
    damage = check_sealed(path)
    if damage is not None:
        raise DamagedFile(f"checkpoint {path} is damaged: {damage}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DamagedFile(f"checkpoint {path} is damaged or not a fedlight checkpoint ({type(e).__name__}: "
                          f"{first})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"`resume` checkpoint {path} is not a fedlight checkpoint (format "
                          f"{ckpt.get('format') if isinstance(ckpt, dict) else type(ckpt).__name__})")
    return ckpt


def disk_error(e: OSError) -> bool:
    """An error of the storage itself (full, over quota, read-only, failing, gone), not of the program."""
    return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ENOENT, errno.ESTALE)
