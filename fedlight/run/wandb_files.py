"""What a W&B run's local files hold, and keeping them inside a movable run directory.

W&B writes every record it accepts to ``<save_dir>/wandb/[offline-]run-<time>-<id>/run-<id>.wandb`` (a LevelDB-style
log of protobuf records) before it uploads it; a resumed run adds one such folder per segment. W&B buffers that
file: a SIGKILL loses the rounds it had accepted but not written, though ``trackers.json`` counted them as sent.
:func:`rounds_held` reads the rounds those files really hold, so a resume sends the rest again
(:class:`fedlight.run.trackers.Trackers`). :func:`relink` turns the absolute symlinks W&B makes in ``files/`` for
the run's uploaded files into relative ones, which still resolve once the run directory is moved.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768  # the log's block size; a record is cut into pieces at block ends
STEP = "trainer/global_step"  # the round, as Lightning's WandbLogger logs it


def records(path: Path) -> Iterator:
    """The records of one ``.wandb`` file, up to the last whole one (a file cut short by a kill ends early)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf = Path(path).read_bytes(), 7, b""
    if data[:4] != b":W&B":
        return
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a piece's header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0 or pos + 7 + n > len(data):
            return
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def run_files(save_dir: Path, run_id: str) -> list[Path]:
    """The ``.wandb`` files of W&B run ``run_id`` under ``save_dir`` (one per segment of a resumed run)."""
    return sorted(Path(save_dir, "wandb").glob(f"*run-*-{run_id}/run-{run_id}.wandb"))


def rounds_held(save_dir: Path, run_id: str) -> tuple[set[int], bool] | None:
    """(the rounds W&B's files for ``run_id`` hold, whether they hold the run's config); ``None``: no file found
    (another folder, or removed), so nothing can be told."""
    files = run_files(save_dir, run_id)
    if not files:
        return None
    rounds, config = set(), False
    for f in files:
        for r in records(f):
            kind = r.WhichOneof("record_type")
            config = config or kind == "config" and any(u.key != "_wandb" for u in r.config.update)
            if kind == "history":
                rounds |= {int(json.loads(i.value_json)) for i in r.history.item if i.key == STEP}
    return rounds, config


def relink(files_dir: Path, root: Path) -> None:
    """Absolute symlinks in ``files_dir`` to files inside ``root`` become relative (they resolve after a move)."""
    for link in Path(files_dir).rglob("*"):
        target = Path(os.readlink(link)) if link.is_symlink() else None
        if target is not None and target.is_absolute() and target.is_relative_to(root.resolve()):
            link.unlink()
            link.symlink_to(os.path.relpath(target, link.parent.resolve()))
