"""Carry a data set to a machine that takes at most ~64 MiB per transfer: pack a folder into parts, each below a size
limit and with its SHA-256, and on the other side check and reassemble them.

    python tools/data_parts.py cifar10 .gpu/staging               # the decoded CIFAR-10 as torchvision's pickles
    python tools/data_parts.py pack .gpu/staging/cifar-10-batches-py .gpu/parts   # parts of at most 40 MiB
    python tools/data_parts.py unpack .gpu/parts .gpu/data        # there: checks every part, then extracts

``cifar10 DEST`` writes ``DEST/cifar-10-batches-py`` (``data_batch_1..5``, ``test_batch``) from the data root's
CIFAR-10 (``$FEDLIGHT_DATA``: the JPEG copy is decoded by fedlight's own loader, so the pixels, their order and a
``subset``'s choice are those fedlight reads here; ``fedlight.data.CIFAR10`` reads the pickles first).
``pack SRC PARTS`` writes ``PARTS/<name>.tar.xz.partNN`` (an xz stream with a delta filter, which suits image rows)
and ``PARTS/<name>.manifest.json``: each part's size and SHA-256, the whole stream's, and every file's. ``unpack
PARTS DEST`` checks the parts that are there, says which are missing (exit 3: bring them, run it again), joins
them, checks the whole and extracts ``DEST/<name>``, then checks every file against the manifest; a folder already
there and matching is left as it is (exit 0), one that does not match is refused (exit 2)."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import pickle
import sys
import tarfile
from pathlib import Path

FILTERS = [{"id": lzma.FILTER_DELTA, "dist": 1}, {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
CHUNK = 1 << 20
PART_MIB = 40.0
"""Default largest part: the decoded CIFAR-10 (123.7 MB packed) in three parts (40, 40 and 37.9 MiB); each call then
carries one part, the manifest and the wheels (1 MiB) beside a checkout of ~6.1 MiB (6.4 MB), 47.1 MiB at most,
which leaves room under the 64 MiB a call may carry for one 15 MiB part of a window's unfinished runs
(tools/resume_runs.py)."""


class PartsError(Exception):
    """A part missing (``code`` 3) or not what the manifest says (``code`` 2)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):  # noqa: B023 - f is this call's file
            h.update(chunk)
    return h.hexdigest()


def files_of(folder: Path) -> dict[str, str]:
    """``relative path -> SHA-256`` of every file under ``folder`` (sorted)."""
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def pack(src: Path, parts: Path, part_mib: float = PART_MIB) -> dict:
    """Tar + xz ``src`` into parts of at most ``part_mib`` MiB under ``parts``; returns the manifest (also written)."""
    src = Path(src)
    if not src.is_dir():
        raise PartsError(f"pack: {src} is not a folder")
    if part_mib <= 0:
        raise PartsError(f"--part-mib must be positive, got {part_mib}")
    parts.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(src.rglob("*")):
            info = tar.gettarinfo(p, arcname=f"{src.name}/{p.relative_to(src)}")
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""  # the same bytes every time
            with open(p, "rb") if p.is_file() else io.BytesIO() as f:
                tar.addfile(info, f if p.is_file() else None)
    stream = lzma.compress(buf.getvalue(), format=lzma.FORMAT_XZ, filters=FILTERS)
    return write_parts(stream, {"name": src.name, "files": files_of(src)}, parts, part_mib)


def write_parts(stream: bytes, manifest: dict, parts: Path, part_mib: float) -> dict:
    """Split ``stream`` into ``parts/<name>.tar.xz.partNN`` of at most ``part_mib`` MiB; write the manifest."""
    limit = int(part_mib * (1 << 20))
    if limit < 1:
        raise PartsError(f"--part-mib must be positive, got {part_mib}")
    for old in parts.glob(f"{manifest['name']}.tar.xz.part*"):
        old.unlink()
    manifest = {"name": manifest["name"], "bytes": len(stream), "sha256": hashlib.sha256(stream).hexdigest(),
                "part_mib": part_mib, "parts": [], "files": manifest["files"]}
    for i, start in enumerate(range(0, len(stream), limit), 1):
        piece = stream[start:start + limit]
        name = f"{manifest['name']}.tar.xz.part{i:02d}"
        (parts / name).write_bytes(piece)
        manifest["parts"].append({"name": name, "bytes": len(piece), "sha256": hashlib.sha256(piece).hexdigest()})
    (parts / f"{manifest['name']}.manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def resplit(parts: Path, part_mib: float) -> dict:
    """The packed stream under ``parts`` cut again into parts of at most ``part_mib`` MiB (no recompression)."""
    manifest = manifest_of(parts)
    check_parts(parts, manifest)
    stream = b"".join((parts / p["name"]).read_bytes() for p in manifest["parts"])
    if hashlib.sha256(stream).hexdigest() != manifest["sha256"]:
        raise PartsError("resplit: the joined parts differ from the manifest's SHA-256; pack again")
    return write_parts(stream, manifest, parts, part_mib)


def manifest_of(parts: Path) -> dict:
    found = sorted(Path(parts).glob("*.manifest.json"))
    if len(found) != 1:
        raise PartsError(f"unpack: {parts} must hold exactly one *.manifest.json (found {len(found)}); bring the "
                         "manifest `pack` wrote", code=3 if not found else 2)
    return json.loads(found[0].read_text())


def check_parts(parts: Path, manifest: dict) -> None:
    """Every part there, of its size and SHA-256; else :class:`PartsError` naming the missing / wrong ones."""
    missing = [p["name"] for p in manifest["parts"] if not (parts / p["name"]).is_file()]
    wrong = [p["name"] for p in manifest["parts"] if p["name"] not in missing
             and ((parts / p["name"]).stat().st_size != p["bytes"] or sha256(parts / p["name"]) != p["sha256"])]
    if wrong:
        raise PartsError(f"unpack: {', '.join(wrong)} differ from the manifest (size or SHA-256): bring them again")
    if missing:
        have = len(manifest["parts"]) - len(missing)
        raise PartsError(f"unpack: {have} of {len(manifest['parts'])} parts here; missing {', '.join(missing)}: "
                         "bring them (each call may carry its own) and run unpack again", code=3)


def unpack(parts: Path, dest: Path) -> Path:
    """Check the parts, join and extract them as ``dest/<name>``, check every file; returns that folder."""
    parts, dest = Path(parts), Path(dest)
    manifest = manifest_of(parts)
    target = dest / manifest["name"]
    if target.is_dir():
        if files_of(target) == manifest["files"]:
            return target
        raise PartsError(f"unpack: {target} exists and differs from the manifest; delete it and run unpack again")
    check_parts(parts, manifest)
    h, chunks = hashlib.sha256(), []
    for p in manifest["parts"]:
        data = (parts / p["name"]).read_bytes()
        h.update(data)
        chunks.append(data)
    if h.hexdigest() != manifest["sha256"]:
        raise PartsError("unpack: the joined parts differ from the manifest's SHA-256; bring the parts again")
    tmp = dest / f".{manifest['name']}.partial-{os.getpid()}"
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(b"".join(chunks))), mode="r") as tar:
        tar.extractall(tmp, filter="data")
    got = files_of(tmp / manifest["name"])
    if got != manifest["files"]:
        raise PartsError(f"unpack: the extracted files differ from the manifest ({len(got)} files, manifest "
                         f"{len(manifest['files'])}); {tmp} kept for a look")
    os.replace(tmp / manifest["name"], target)
    tmp.rmdir()
    return target


def cifar10_pickles(dest: Path, root: Path | None = None) -> Path:
    """``dest/cifar-10-batches-py`` from the data root's CIFAR-10, decoded as fedlight decodes it (class-major
    order, as the ImageFolder copy lists it)."""
    import numpy as np

    from fedlight.data.base import data_root
    from fedlight.data.vision import decode_subset, list_folder

    root = data_root(root)
    folder = next((root / f for f in ("cifar10-jpeg", "cifar10") if (root / f / "train").is_dir()), None)
    if folder is None:
        raise PartsError(f"cifar10: no CIFAR-10 ImageFolder copy (cifar10-jpeg/ or cifar10/) under {root}; set "
                         "FEDLIGHT_DATA")
    out = Path(dest) / "cifar-10-batches-py"
    out.mkdir(parents=True, exist_ok=True)
    classes = sorted(e.name for e in os.scandir(folder / "train") if e.is_dir())
    for split, names in (("train", [f"data_batch_{i}" for i in range(1, 6)]), ("test", ["test_batch"])):
        files, labels, _ = list_folder(folder / split, classes)
        x, y = decode_subset(files, labels, None, np.random.default_rng(0))
        x = x.numpy().reshape(len(x), -1)
        size = -(-len(x) // len(names))
        for i, name in enumerate(names):
            part = slice(i * size, (i + 1) * size)
            blob = {"batch_label": f"{name} (decoded from {folder.name})", "labels": y[part].tolist(),
                    "data": np.ascontiguousarray(x[part]), "filenames": [os.path.basename(f) for f in files[part]]}
            (out / name).write_bytes(pickle.dumps(blob, protocol=4))
    (out / "batches.meta").write_bytes(pickle.dumps({"label_names": classes, "num_vis": 3072}, protocol=4))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/data_parts.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cifar10", help="write DEST/cifar-10-batches-py from the data root's decoded CIFAR-10")
    c.add_argument("dest", type=Path)
    k = sub.add_parser("pack", help="pack a folder into parts with SHA-256s")
    k.add_argument("src", type=Path)
    k.add_argument("parts", type=Path)
    k.add_argument("--part-mib", type=float, default=PART_MIB, help=f"largest part, MiB (default {PART_MIB:g}: "
                   "one part, the manifest, the wheels, the checkout and a 15 MiB resume part fit one 64 MiB call)")
    r = sub.add_parser("resplit", help="cut packed parts again to another size (no recompression)")
    r.add_argument("parts", type=Path)
    r.add_argument("--part-mib", type=float, default=PART_MIB)
    u = sub.add_parser("unpack", help="check the parts, reassemble and extract DEST/<name>")
    u.add_argument("parts", type=Path)
    u.add_argument("dest", type=Path)
    a = p.parse_args(argv)
    try:
        if a.cmd == "cifar10":
            print(f"wrote {cifar10_pickles(a.dest)}")
        elif a.cmd in ("pack", "resplit"):
            m = pack(a.src, a.parts, a.part_mib) if a.cmd == "pack" else resplit(a.parts, a.part_mib)
            sizes = ", ".join(f"{q['name']} {q['bytes'] / (1 << 20):.1f} MiB" for q in m["parts"])
            print(f"packed {m['name']} ({len(m['files'])} files) into {len(m['parts'])} parts: {sizes}; sha256 "
                  f"{m['sha256'][:16]}…")
        else:
            print(f"unpacked and checked {unpack(a.parts, a.dest)}")
    except PartsError as e:
        print(f"data_parts: {e}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
