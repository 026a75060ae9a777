"""Per-client state store: each client's persistent state (``c_i``, ``h_i``, momenta) keyed by client id.

State survives rounds in which the client is not sampled and lives off the accelerator by default. With a memory
budget, the least recently stored states beyond it spill to one flat file per client (read back through a private
memory map), so 10,000 stateful clients need disk, not RAM. A checkpoint then holds the in-memory states plus a
reference (path, size, crc32) per spilled client: files are written atomically, fsynced before the checkpoint that
names them, and deleted only once two later checkpoints no longer name them (also across a resume: a checkpoint
lists the files of the one before it, ``checkpoints/prev.ckpt``, the fallback if the last one is damaged). Paths are
relative to the run directory (:mod:`fedlight.run.client_files`): a copied or moved run reads, writes and deletes
only its own files.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fedlight.run.atomic import DamagedFile
from fedlight.run.client_files import locate
from fedlight.run.directory import resume_advice

_ALIGN = 64  # byte alignment of each tensor in a spill file (any dtype can be viewed in place)


def _map(obj: Any, fn):
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def _size(obj: Any) -> int:
    leaves: list[Tensor] = []
    _spec(obj, leaves)
    return sum(t.numel() * t.element_size() for t in leaves)


def _spec(obj: Any, leaves: list[Tensor]) -> tuple:
    """A hashable description of ``obj`` with tensors replaced by (dtype, shape); tensors go to ``leaves``."""
    if isinstance(obj, Tensor):
        leaves.append(obj)
        return ("t", str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
    if isinstance(obj, dict):
        return ("d", tuple((k, _spec(v, leaves)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return ("l" if isinstance(obj, list) else "u", tuple(_spec(v, leaves) for v in obj))
    return ("v", obj)


def _layout(spec: tuple, out: list[tuple[int, torch.dtype, tuple]], pos: int = 0) -> int:
    """Byte offsets of the tensors of ``spec`` (appended to ``out``); returns the end offset."""
    kind, body = spec[0], spec[1]
    if kind == "t":
        dtype, shape = getattr(torch, body), spec[2]
        pos = -(-pos // _ALIGN) * _ALIGN
        out.append((pos, dtype, shape))
        return pos + dtype.itemsize * int(torch.Size(shape).numel())
    for item in body if kind in ("l", "u") else [v for _, v in body] if kind == "d" else []:
        pos = _layout(item, out, pos)
    return pos


def _intern(specs: dict[tuple, tuple], spec: tuple) -> tuple:
    try:  # one shared object per distinct layout: 10,000 clients of one model keep one spec
        return specs.setdefault(spec, spec)
    except TypeError:  # an unhashable non-tensor value
        return spec


def _build(spec: tuple, tensors: list[Tensor]) -> Any:
    kind, body = spec[0], spec[1]
    if kind == "t":
        return tensors.pop()
    if kind == "d":
        return {k: _build(v, tensors) for k, v in body}
    if kind in ("l", "u"):
        items = [_build(v, tensors) for v in body]
        return items if kind == "l" else tuple(items)
    return body


class ClientStateStore:
    """Maps client id → state dict (tensors, dicts/lists of tensors, numbers).

    Args:
        device: where in-memory state lives: ``"cpu"`` (default) or an accelerator device.
        budget_bytes: at most this many bytes of state stay in memory; the least recently stored states beyond
            it spill to disk. ``None`` (default): everything stays in memory.
        spill_dir: folder for the spill files (created; put it inside the run directory so checkpoints can
            reference the files). ``None`` with a budget: a temporary folder, removed with the store; checkpoints
            then embed all state.
    """

    def __init__(self, device: str | torch.device = "cpu", budget_bytes: int | None = None,
                 spill_dir: str | os.PathLike | None = None) -> None:
        self.device = torch.device(device)
        self.budget = budget_bytes
        self._mem: OrderedDict[int, tuple[dict[str, Any], int]] = OrderedDict()  # (state, bytes), oldest first
        self.mem_bytes = 0
        self._disk: dict[int, dict[str, Any]] = {}  # cid → {spec, path, nbytes, crc, owned}
        self._specs: dict[tuple, tuple] = {}
        self._token, self._count = secrets.token_hex(4), 0
        self._unsynced: set[Path] = set()
        self._pins: tuple[set[Path], set[Path]] = (set(), set())  # files of the last two exported state_dicts
        self._garbage: set[Path] = set()  # superseded files, deleted once no kept checkpoint names them
        self._temporary = spill_dir is None and budget_bytes is not None
        self.spill_dir = Path(spill_dir).resolve() if spill_dir is not None else None
        if self._temporary:
            self.spill_dir = Path(tempfile.mkdtemp(prefix="fedlight-state-")).resolve()
            weakref.finalize(self, shutil.rmtree, self.spill_dir, True)
        self.root = self.spill_dir  # checkpoints name files relative to it (the run directory, see use_folder)
        self.source: Path | None = None  # the run directory of the checkpoint to load (default: root)

    def use_folder(self, folder: str | os.PathLike, root: str | os.PathLike | None = None) -> None:
        """Let checkpoints reference per-client state files in ``folder`` instead of embedding every state (a run
        directory's ``client_state/rank<r>``): a state is written once after it changes, never again while it does
        not. Memory use is unchanged (without a budget every state also stays in memory). The folder is created on
        the first write. No effect when the store already spills to a folder of its own choosing. ``root``: the run
        directory, which checkpoints name the files relative to (when the folder is inside it)."""
        if self.spill_dir is None:
            self.spill_dir = Path(folder).resolve()
        self.root = self.spill_dir
        if root is not None and not self._temporary and self.spill_dir.is_relative_to(Path(root).resolve()):
            self.root = Path(root).resolve()

    def read_from(self, run_dir: str | os.PathLike) -> None:
        """The checkpoint :meth:`load_state_dict` gets next lives in ``run_dir`` (its files are found there; only
        files inside this store's own folder are ever deleted)."""
        self.source = Path(run_dir).resolve()

    # ------------------------------------------------------------------------------------------- get / put
    def get(self, client_id: int, device: torch.device | str) -> dict[str, Any]:
        """A private copy of the client's state on ``device`` (empty dict for a new client)."""
        if client_id in self._mem:
            return _map(self._mem[client_id][0], lambda t: t.to(device, copy=True))
        if client_id in self._disk:
            return self._read(client_id, device)
        return {}

    def put(self, client_id: int, state: dict[str, Any]) -> None:
        """Store (a copy of) the client's state; an empty state stores nothing."""
        if not state:
            return
        self._drop(client_id)
        copy = _map(state, lambda t: t.detach().to(self.device, copy=True))
        self._mem[client_id] = (copy, _size(copy))
        self.mem_bytes += self._mem[client_id][1]
        while self.budget is not None and self.mem_bytes > self.budget and self._mem:
            cid, (st, n) = self._mem.popitem(last=False)
            self.mem_bytes -= n
            if cid not in self._disk:  # else a checkpoint already wrote this very state
                self._write(cid, st)

    def _drop(self, client_id: int) -> None:
        if client_id in self._mem:
            self.mem_bytes -= self._mem.pop(client_id)[1]
        entry = self._disk.pop(client_id, None)
        if entry is not None and entry["owned"]:
            self._garbage.add(entry["path"])
            self._collect()

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._mem or client_id in self._disk

    def __len__(self) -> int:
        return len(self._mem.keys() | self._disk.keys())

    def ids(self) -> list[int]:
        return sorted(self._mem.keys() | self._disk.keys())

    @property
    def disk_bytes(self) -> int:  # spilled files, and copies a checkpoint wrote of states still in memory
        return sum(e["nbytes"] for e in self._disk.values())

    # ------------------------------------------------------------------------------------------- files
    def _write(self, client_id: int, state: dict[str, Any]) -> None:
        leaves: list[Tensor] = []
        spec = _intern(self._specs, _spec(state, leaves))
        offsets: list[tuple[int, torch.dtype, tuple]] = []
        _layout(spec, offsets)
        self._count += 1
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        tmp, crc, end = self.spill_dir / f"c{client_id}-{self._token}-{self._count}.tmp", 0, 0
        with open(tmp, "wb") as f:
            for (pos, _, _), t in zip(offsets, leaves):
                for chunk in (bytes(pos - end), t.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy()):
                    f.write(chunk)
                    crc = zlib.crc32(chunk, crc)
                end = pos + t.numel() * t.element_size()
        path = tmp.with_name(f"{tmp.stem}-{crc:08x}.bin")  # the name carries the CRC: checkable with no checkpoint
        os.replace(tmp, path)
        self._unsynced.add(path)
        self._disk[client_id] = {"spec": spec, "path": path, "nbytes": end, "crc": crc, "owned": True}

    def _read(self, client_id: int, device: torch.device | str) -> dict[str, Any]:
        e = self._disk[client_id]
        try:
            buf = torch.from_file(str(e["path"]), shared=False, size=e["nbytes"], dtype=torch.uint8) if e["nbytes"] \
                else torch.empty(0, dtype=torch.uint8)
        except (OSError, RuntimeError) as err:  # removed or truncated since the checks before round 1
            raise DamagedFile(f"client {client_id}'s state file {e['path']} is damaged: it is missing or truncated "
                              f"({str(err).splitlines()[0][:120]}); {resume_advice(e['path'])}") from None
        if zlib.crc32(buf.numpy()) != e["crc"]:  # every read: a file this run wrote can be damaged since too
            raise DamagedFile(f"client {client_id}'s state file {e['path']} is damaged: its bytes differ from the ones "
                              f"written (CRC-32 mismatch); {resume_advice(e['path'])}")
        offsets: list[tuple[int, torch.dtype, tuple]] = []
        _layout(e["spec"], offsets)
        tensors = [buf[p: p + d.itemsize * int(torch.Size(s).numel())].view(d).view(s).to(device, copy=True)
                   for p, d, s in offsets]  # one allocation per tensor, like states that never spilled
        return _build(e["spec"], tensors[::-1])

    def _collect(self) -> None:
        for path in [p for p in self._garbage if p not in self._pins[0] and p not in self._pins[1]]:
            path.unlink(missing_ok=True)
            self._garbage.discard(path)
            self._unsynced.discard(path)

    def _here(self, recorded: str) -> Path:
        """The file a checkpoint names: relative to the checkpoint's run directory; an absolute path (an older
        checkpoint) is looked up inside it, then in this store's folder (a store without a run directory)."""
        base = self.source or self.root
        path = locate(base, recorded) if base is not None else Path(recorded)
        if not path.is_file() and self.spill_dir is not None and (self.spill_dir / path.name).is_file():
            return self.spill_dir / path.name
        return path

    def _name(self, path: Path) -> str:
        """How a checkpoint names ``path``: relative to the run directory (a moved or copied run finds its own)."""
        return path.relative_to(self.root).as_posix() if self.root and path.is_relative_to(self.root) else str(path)

    # ------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self, materialize: bool | None = None) -> dict[str, Any]:
        """Everything needed to restore the store, for a checkpoint. With a spill folder every state is referenced by
        file: in-memory states not yet on disk are written (and stay in memory), files are fsynced here and kept until
        two later checkpoints no longer name them, so a checkpoint is small whatever the budget. ``materialize``
        (default: without a spill folder, or a temporary one) embeds the data instead, e.g. to export a run."""
        states = {int(k): v for k, (v, _) in self._mem.items()}
        if self._temporary or self.spill_dir is None if materialize is None else materialize:
            return {"states": {**{int(k): self._read(k, "cpu") for k in self._disk.keys() - states}, **states}}
        for cid, (st, _) in self._mem.items():
            if cid not in self._disk:
                self._write(cid, st)
        for cid in [c for c, e in self._disk.items() if not e["owned"]]:  # resumed from another run's files
            self._write(cid, self._read(cid, "cpu"))
        for path in [*self._unsynced, self.spill_dir] if self._unsynced else []:
            fd = os.open(path, os.O_RDONLY)  # the files, then the folder's entries for them
            os.fsync(fd)
            os.close(fd)
        self._unsynced.clear()
        self._pins = (self._pins[1], {e["path"] for e in self._disk.values()})
        self._collect()
        return {"states": {}, "spilled": {int(k): {"spec": e["spec"], "path": self._name(e["path"]), "nbytes":
                                                   e["nbytes"], "crc": e["crc"]} for k, e in self._disk.items()},
                "previous": sorted(self._name(p) for p in self._pins[0]),  # the files the checkpoint before names
                "paths": "relative"}  # to the run directory (older checkpoints: absolute)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        for cid in self.ids():
            self._drop(cid)
        referenced = set()
        for cid, e in d.get("spilled", {}).items():
            path = self._here(e["path"])
            if not path.is_file() or path.stat().st_size != e["nbytes"]:
                raise DamagedFile(f"client {cid}'s state file {path} is missing or truncated; the checkpoint names "
                                  "files in its run directory's client_state/ folder")
            owned = self.spill_dir is not None and path.parent == self.spill_dir
            spec = _intern(self._specs, e["spec"])
            self._disk[int(cid)] = {"spec": spec, "path": path, "nbytes": e["nbytes"], "crc": e["crc"],
                                    "owned": owned}
            referenced.add(path)
        # The checkpoint before this one (checkpoints/prev.ckpt, the fallback) names these: kept until two later
        # checkpoints no longer do, as in the run that wrote them; then deleted like any superseded file.
        previous = {self._here(f) for f in d.get("previous", [])}
        self._pins = (previous, referenced)
        self._garbage |= {f for f in previous - referenced if self.spill_dir is not None and f.parent == self.spill_dir}
        for cid, state in d["states"].items():
            self.put(int(cid), state)
        if self.spill_dir is not None:  # files of this folder no one references: left by a killed run
            keep = {e["path"] for e in self._disk.values()} | previous
            for f in [*self.spill_dir.glob("c*-*-*.bin"), *self.spill_dir.glob("c*-*-*.tmp")]:
                if f not in keep:
                    f.unlink(missing_ok=True)
