"""Carry a table's unfinished runs from one lent GPU machine to the next (the machine is wiped when given back).

    python tools/resume_runs.py pack TABLE OUT        # there, after the runs stopped: OUT/resume.tar.gz[.partNN]
    python tools/resume_runs.py restore DIR TABLE     # there, next window, before the runs: DIR holds those files

``pack`` takes every run folder ``TABLE/<row>/<column>/seed<k>`` that has a checkpoint and is not finished, and
writes what ``--resume auto`` needs of it: the checkpoint it continues from (``checkpoints/last.ckpt``; ``prev.ckpt``
only when the last is missing or damaged; never both), the client-state files that checkpoint names
(``client_state/rank0/*.bin``, one per client that has a state: SCAFFOLD's and FedGAMMA's control variates,
FedSMOO's two per-client tensors), ``metrics.jsonl`` (a resume refuses a checkpoint whose earlier rows are missing),
``config.yaml``, ``reproduce.json`` (what made the run: ``fedlight reproduce`` refuses a folder another command made)
and ``job.json``. Not carried: older checkpoints and the files only they name, ``tb/``, ``fit.log`` (a resumed run
starts new ones).

One call brings back at most 8 files of at most 16 MiB, 64 MiB together: the archive is ``resume.tar.gz`` up to
16 MiB, else ``resume.tar.gz.part01..`` of 15 MiB, as many as the files already in OUT leave room for (and at most
``--parts``). Runs go in furthest along first (their checkpoint's round); one that does not fit is left out and
named, and the next ones are tried. ``restore`` joins and checks the parts (gzip's CRC: a missing or damaged part
is refused, exit 2), and puts each run in place of the table's own folder unless that run is finished there or its
checkpoint is at the same round or later; it says per run what it did.
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import shutil
import sys
import tarfile
import zlib
from pathlib import Path

MIB = 1 << 20
NAME = "resume.tar.gz"
WHOLE, PART = 16 * MIB, 15 * MIB  # an archive up to WHOLE stays one file; above, parts of PART
CALL_FILES, CALL_BYTES = 8, 63 * MIB  # what one call brings back (64 MiB, less a margin for the log's last lines)
PARTS = 4
"""Default most parts: four of 15 MiB; they ride in calls of their own (docs/contributing/gpu_table.md)."""
SIDE = ("metrics.jsonl", "config.yaml", "reproduce.json", "job.json")
LEVEL = 1  # float32 weights deflate by ~9 % at any level: the fastest one, also for the size estimate


class ResumeError(Exception):
    pass


def runs_of(table: Path) -> list[Path]:
    return sorted(p for p in Path(table).glob("*/*/seed*") if p.is_dir())


def resumable(run: Path) -> tuple[int, list[Path]] | None:
    """``(round, files)``: the round ``--resume auto`` continues ``run`` from and the files it needs; ``None``
    when the run is finished or has no usable checkpoint."""
    from fedlight.errors import ConfigError
    from fedlight.lab.tables.report import finished
    from fedlight.run.client_files import locate, named
    from fedlight.run.directory import load_resume

    last = run / "checkpoints" / "last.ckpt"
    path = last if last.is_file() else last.with_name("prev.ckpt")  # prev alone: killed between the two renames
    if finished(run) or not path.is_file():
        return None
    try:
        path, ckpt = load_resume(path, auto=True, note=lambda m: print(f"{run}: {m}"))
    except ConfigError as e:
        print(f"{run}: no usable checkpoint ({e})")
        return None
    states = [locate(run, e["path"]) for _, e in named(ckpt)]
    return int(ckpt["round"]), [path, *states, *(run / n for n in SIDE if (run / n).is_file())]


def deflated(files: list[Path], cap: int) -> int:
    """Bytes of ``files`` in the archive (deflated one by one, with their tar headers: a little above what the
    archive takes), counted until they pass ``cap``."""
    n = 0
    for f in files:
        z = zlib.compressobj(LEVEL)
        with open(f, "rb") as fh:
            while n <= cap and (chunk := fh.read(MIB)):
                n += len(z.compress(chunk))
        n += len(z.flush()) + 1024
    return n


def archive(table: Path, chosen: list) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=LEVEL) as tar:
        for _, _, files in chosen:
            for f in files:
                tar.add(f, arcname=str(f.relative_to(table)))
    return buf.getvalue()


def budget_of(out: Path, parts: int) -> int:
    """The bytes the archive may take beside the files already in ``out``."""
    here = [f for f in out.iterdir() if f.is_file()]
    slots = min(parts, CALL_FILES - len(here))
    if slots <= 0:
        return 0
    return max(0, min(WHOLE if slots == 1 else slots * PART, CALL_BYTES - sum(f.stat().st_size for f in here)))


def label(table: Path, item) -> str:
    run, rnd, files = item
    return f"{run.relative_to(table)} (round {rnd}, {sum(f.stat().st_size for f in files) / MIB:.1f} MiB of files)"


def pack(table: Path, out: Path, parts: int = PARTS) -> list[str]:
    """Write the unfinished runs of ``table`` under ``out``; returns the names written (also printed)."""
    table, out = Path(table), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(NAME + "*"):
        old.unlink()
    found = [(run, *r) for run in runs_of(table) if (r := resumable(run)) is not None]
    found.sort(key=lambda x: -x[1])  # furthest along first
    budget, chosen, left, used = budget_of(out, parts), [], [], 10240
    for item in found:
        size = deflated(item[2], budget - used)
        if used + size <= budget:
            chosen.append(item)
            used += size
        else:
            left.append(item)
    blob = archive(table, chosen) if chosen else b""
    while len(blob) > budget:  # the estimate fell short: the run least far along goes
        left.append(chosen.pop())
        blob = archive(table, chosen) if chosen else b""
    names = [] if not chosen else [NAME] if len(blob) <= WHOLE else \
        [f"{NAME}.part{i:02d}" for i in range(1, -(-len(blob) // PART) + 1)]
    step = len(blob) if len(names) == 1 else PART
    for i, name in enumerate(names):
        (out / name).write_bytes(blob[i * step:(i + 1) * step])
    if not found:
        print("resume: no unfinished run with a checkpoint")
    if chosen:
        print(f"resume: {len(chosen)} unfinished runs in {', '.join(names)} ({len(blob) / MIB:.1f} MiB of "
              f"{budget / MIB:.1f} allowed): {', '.join(label(table, c) for c in chosen)}")
    if left:
        left.sort(key=lambda x: -x[1])
        print(f"resume: LEFT OUT, no room in {budget / MIB:.1f} MiB (a fresh machine starts them again from round "
              f"0): {', '.join(label(table, c) for c in left)}")
    return names


def joined(src: Path) -> bytes | None:
    """The archive under ``src`` (whole, or its parts joined), checked; ``None``: there is none."""
    whole, parts = src / NAME, sorted(src.glob(NAME + ".part*"))
    if whole.is_file() and parts:
        raise ResumeError(f"{src} holds both {NAME} and parts: keep one window's files only")
    if not whole.is_file() and not parts:
        return None
    want = [f"{NAME}.part{i:02d}" for i in range(1, len(parts) + 1)]
    if [p.name for p in parts] != want:
        raise ResumeError(f"{src}: parts {', '.join(p.name for p in parts)} are not part01..part{len(parts):02d}")
    try:
        return gzip.decompress(b"".join(p.read_bytes() for p in parts or [whole]))
    except (OSError, EOFError, zlib.error) as e:
        raise ResumeError(f"{src}: the archive is incomplete or damaged ({e}): bring every part of one window, "
                          "or remove them to start the runs afresh") from None


def restore(src: Path, table: Path) -> None:
    """Put the runs of the archive under ``src`` into ``table`` (see the module's docstring)."""
    src, table = Path(src), Path(table)
    raw = joined(src) if src.is_dir() else None
    if raw is None:
        print(f"resume: no {NAME} in {src}: nothing to restore")
        return
    from fedlight.lab.tables.report import finished

    table.mkdir(parents=True, exist_ok=True)
    tmp = table.parent / f".{table.name}.resume-{os.getpid()}"
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        tar.extractall(tmp, filter="data")
    try:
        for run in runs_of(tmp):
            rel, got = run.relative_to(tmp), resumable(run)
            to = table / rel
            here = resumable(to)
            if got is None:
                print(f"resume: {rel}: no usable checkpoint in the archive; not restored")
            elif finished(to):
                print(f"resume: {rel}: kept (finished here)")
            elif here is not None and here[0] >= got[0]:
                print(f"resume: {rel}: kept (here at round {here[0]}; the archive's is at round {got[0]})")
            else:
                shutil.rmtree(to, ignore_errors=True)
                to.parent.mkdir(parents=True, exist_ok=True)
                os.replace(run, to)
                print(f"resume: {rel}: restored at round {got[0]}" + (f" (here: round {here[0]})" if here else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/resume_runs.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("pack", help="write the unfinished runs of TABLE as OUT/resume.tar.gz[.partNN]")
    k.add_argument("table", type=Path)
    k.add_argument("out", type=Path)
    k.add_argument("--parts", type=int, default=PARTS, help=f"most parts (default {PARTS})")
    r = sub.add_parser("restore", help="put the runs of DIR/resume.tar.gz[.partNN] into TABLE")
    r.add_argument("src", type=Path)
    r.add_argument("table", type=Path)
    a = p.parse_args(argv)
    try:
        pack(a.table, a.out, a.parts) if a.cmd == "pack" else restore(a.src, a.table)
    except ResumeError as e:
        print(f"resume_runs: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
