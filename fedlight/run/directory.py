"""The run directory before the first byte: where it is, who holds it, and whether a resume may continue it.

Everything here only reads, except :class:`RunLock`, whose lock file is removed again when the run ends (or is
refused), so a refused run leaves the directory byte-identical.

Settings split in two:

* **defining** settings change what is computed: seed, model, data (dataset, partition, batch size, ...),
  algorithm and its hyperparameters, precision, and every ``loop`` field not listed below. Resuming refuses a
  checkpoint whose defining settings differ, listing the differences; the default run directory name carries a
  short hash of them, so runs that differ never share a directory.
* **execution-only** settings (:data:`EXECUTION_ONLY`) change how or where the same numbers are computed, or what is
  reported about them. They may change between the segments of a resumed run; each segment is recorded.
  ``loop.rounds`` may grow (a run is extended) except under the cosine schedule, whose learning rates depend on it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError

EXECUTION_ONLY = ("out_dir", "resume", "overwrite", "accelerator", "devices", "num_nodes", "loop.client_parallelism",
                  "loop.vmap_chunk", "loop.compile", "loop.channels_last", "loop.matmul_convs", "loop.progress",
                  "loop.save_every", "loop.eval_every", "loop.targets", "loop.state_device", "loop.state_budget_mb",
                  "loop.rounds", "data.init_args.root", "loggers")
"""Keys (dotted) that may differ between the segments of one run."""

LOCK_NAME = ".fedlight.lock"

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "tb", "final_model.pt", "client_state",
             "trackers.json", "csv", "wandb")
"""What a run writes in its directory (beside it, e.g., a table's ``fit.log`` and ``job.json``)."""


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"loop": {"lr": 0.1}}`` → ``{"loop.lr": 0.1}`` (lists and scalars are leaves)."""
    if not isinstance(d, dict) or (prefix and not d):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def split_settings(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(defining, execution-only) flat settings of a resolved config."""
    flat = flatten(settings)
    execution = {k: v for k, v in flat.items() if _execution_only(k, flat)}
    return {k: v for k, v in flat.items() if k not in execution}, execution


def _execution_only(key: str, flat: dict[str, Any]) -> bool:
    if key == "loop.rounds" and flat.get("loop.lr_schedule.kind") == "cosine":
        return False
    return any(key == e or key.startswith(e + ".") for e in EXECUTION_ONLY)


def settings_hash(defining: dict[str, Any]) -> str:
    """A short stable hash of the defining settings (names a default run directory)."""
    text = json.dumps(defining, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def differences(there: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """``key is A there and B here`` for every defining setting that differs. ``here`` holds the clip that
    ``loop.max_grad_norm: auto`` resolved to (:func:`fedlight.config.settings.resolve_clip`); a checkpoint that
    recorded ``auto`` itself (written before it was resolved) is of the same model, so it resolved the same."""
    if there.get("loop.max_grad_norm") == "auto":
        there = {**there, "loop.max_grad_norm": here.get("loop.max_grad_norm", "auto")}
    out = []
    for k in sorted(there.keys() | here.keys()):
        a, b = there.get(k, "<unset>"), here.get(k, "<unset>")
        if json.dumps(a, default=str) != json.dumps(b, default=str):
            out.append(f"{k} is {a!r} there and {b!r} here")
    return out


def check_out_dir(out: Path) -> None:
    """``out`` must be a directory (or creatable) on a writable file system; raises :class:`ConfigError`."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"`out_dir` {out} exists and is not a directory; choose another `--out_dir`")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"`out_dir` {out} cannot be created: {probe} is a file; choose another `--out_dir`")
    virtual = _virtual_fs(probe)
    if virtual is not None:
        raise ConfigError(f"`out_dir` {out} cannot be used: it is on {virtual}, a kernel file system that cannot "
                          "hold a run's files; choose another `--out_dir`")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"`out_dir` {out} is not writable ({probe} is read-only or not yours); choose another "
                          "`--out_dir`")


VIRTUAL_FS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
              "pstore", "bpf", "configfs", "fusectl", "mqueue", "binfmt_misc", "autofs", "efivarfs"}


def _virtual_fs(path: Path) -> str | None:
    """The kernel file system (``proc``, ``sysfs``, ...) ``path`` lies on, from ``/proc/self/mounts``; ``None``: a
    real one (or unknown)."""
    try:
        real = os.path.realpath(path)
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except (OSError, IndexError, ValueError):
        return None
    best = ("", "")
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, kind)
    return f"{best[0]} ({best[1]})" if best[1] in VIRTUAL_FS else None


def snapshot(out: Path) -> tuple[tuple[str, int, int], ...]:
    """What a run's start decisions read in ``out``: names, sizes and modification times of the run's own files
    (:data:`RUN_FILES`; not what a launcher writes beside them, such as ``fit.log``) and of those in ``checkpoints/``.
    Equal before and after the lock is taken, or another run wrote there in between. A missing directory reads as an
    empty one."""
    entries = []
    for folder, only in ((Path(out), RUN_FILES), (Path(out) / "checkpoints", None)):
        try:
            with os.scandir(folder) as it:
                for e in it:
                    if only is None or e.name in only:
                        st, file = e.stat(follow_symlinks=False), e.is_file(follow_symlinks=False)
                        entries.append((os.path.join(folder.name, e.name), st.st_size if file else -1,
                                        st.st_mtime_ns if file else 0))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return tuple(sorted(entries))


class RunLock:
    """An exclusive lock on a run directory for the life of a run (``flock`` on ``<out>/.fedlight.lock``).

    The kernel drops the lock when its holder dies, so a lock file left by a killed run is taken over; the file
    names the holder (pid, host, start time) for the message a second run gets. Only global rank 0 takes it.
    """

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / LOCK_NAME
        self.fd: int | None = None
        self.created_dir = False

    def acquire(self, expected: tuple | None = None) -> None:
        """Take the lock (a second run gets one message naming the holder). ``expected``: the directory's
        :func:`snapshot` when this run decided how to start (resume or fresh): a directory another run changed in
        the meantime (it held the lock, wrote and let go) refuses this run, which decided on what is no longer
        there."""
        try:
            self.created_dir = not self.path.parent.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    os.close(fd)
                    if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a file system without locks
                        print(f"fedlight: warning: {self.path.parent} cannot be locked ({e.strerror}); make sure no "
                              "other run uses it", file=sys.stderr)
                        self.path.unlink(missing_ok=True)
                        return
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    raise ConfigError(f"`out_dir` {self.path.parent} is in use by another run ({self._holder()}); "
                                      "wait for it to finish or choose another `--out_dir`") from None
                if _same_file(fd, self.path):  # else the holder removed it between our open and flock: retry
                    break
                os.close(fd)
        except OSError as e:
            raise ConfigError(f"`out_dir` {self.path.parent} cannot be used: {e.strerror or e}; choose another "
                              "`--out_dir`") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self.fd = fd
        if expected is not None and snapshot(self.path.parent) != expected:
            try:
                self.release(refused=True)
            except OSError:
                pass  # the refusal is the message; a lock file left behind is taken over by the next run
            raise ConfigError(f"`out_dir` {self.path.parent} changed while this run was starting: another run wrote "
                              "to it before this one took its lock; run the command again (it decides afresh: "
                              "`--resume auto` continues that run) or choose another `--out_dir`")

    def _holder(self) -> str:
        try:
            h = json.loads(self.path.read_text() or "{}")
            return f"pid {h['pid']} on {h['host']} since {h['since']}"
        except (OSError, ValueError, KeyError):
            return "holder unknown"

    def release(self, refused: bool = False) -> None:
        """Unlock; the lock file is removed (and the directory, if this run created it and it stayed empty). The lock
        is let go even when its file cannot be removed (the folder turned read-only): that failure is then raised, an
        :class:`OSError` naming the file (a lock file left behind is taken over by the next run)."""
        if self.fd is None:
            return
        try:
            from fedlight.run import faults

            faults.on_write(self.path)  # removing the file writes the folder
            self.path.unlink(missing_ok=True)
        except OSError as e:
            raise OSError(e.errno, e.strerror or str(e), str(self.path)) from None
        finally:
            os.close(self.fd)
            self.fd = None
        if refused and self.created_dir:
            try:
                self.path.parent.rmdir()
            except OSError:
                pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def load_resume(path: Path | None, auto: bool, note=print) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint at ``path``; when it is a damaged ``last.ckpt`` (or one naming a damaged client-state file),
    ``--resume auto`` takes the previous good one (``prev.ckpt``, saying so through ``note``) and an explicit path is
    refused naming it."""
    from fedlight.run.atomic import DamagedFile

    if path is None:
        return None, None
    try:
        return path, _load_whole(path)
    except DamagedFile as e:
        prev = path.with_name("prev.ckpt")
        if path.name != "last.ckpt" or not prev.is_file():
            raise
        try:
            ckpt = _load_whole(prev)
        except ConfigError as e2:
            raise DamagedFile(f"{e}; the previous one is unusable too: {e2}") from None
        if not auto:
            raise DamagedFile(f"{e}. The previous checkpoint {prev} (round {ckpt['round']}) is intact: continue from "
                              f"it with `--resume auto` or `--resume {prev}`") from None
        note(f"{e}; continuing from the previous good checkpoint {prev} (round {ckpt['round']}), the rounds after "
             "it are recomputed")
        return prev, ckpt


def _load_whole(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path``, sealed bytes and every client-state file it names checked (size and CRC-32)."""
    from fedlight.run.atomic import DamagedFile, load_checkpoint
    from fedlight.run.client_files import named_damage

    ckpt = load_checkpoint(path)
    bad = named_damage(path.parent.parent, ckpt)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        file, cid, why = bad[0]
        raise DamagedFile(f"checkpoint {path} names client {cid}'s state file {file}{more}, which is damaged: {why}")
    return ckpt


def resume_advice(state_file: Path) -> str:
    """What continues a run after its client-state file ``state_file`` (``RUN/client_state/rank<r>/...``) turned out
    damaged mid-run: ``--resume auto`` when the checkpoint it would take (or the previous one) is intact with every
    file it names; else what does, since ``--resume auto`` would refuse too."""
    last = Path(state_file).parent.parent.parent / "checkpoints" / "last.ckpt"
    last = last if last.exists() or not last.with_name("prev.ckpt").exists() else last.with_name("prev.ckpt")
    if last.exists():
        try:
            load_resume(last, True, note=lambda message: None)
        except ConfigError:
            return ("`--resume auto` cannot continue: every checkpoint names a damaged client-state file; put back an "
                    "intact copy of the file, or start over with `--overwrite true`")
    return "continue with `--resume auto`, which checks every file a checkpoint names before round 1"
