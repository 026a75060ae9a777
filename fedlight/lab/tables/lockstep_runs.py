"""``fedlight reproduce --lockstep``: the runs of a table that can share a stacked chunk, run as lockstep groups.

Runs share a group when they differ only in their seed and in the server side of their rule: the seeds of a row,
and the rows whose local rule is the same (FedAvg and FedAvgM; not SAM rows with plain ones, nor stateful rows with
stateless ones, whose steps cost differently), in the same column. A group is one ``fedlight lockstep`` process
(:mod:`fedlight.config.group`): each run keeps its own directory, ``reproduce.json``, ``job.json`` and ``fit.log``
(the group's log, copied), and its own outcome. The group itself only trains together what really shares a chunk
(:func:`fedlight.engine.lockstep.shares_chunk`), so a key that groups too much costs speed, never numbers.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlight.errors import ConfigError, check
from fedlight.lab.tables.runner import Run
from fedlight.lab.tables.spec import base_path


def parse_mode(text: str) -> int | str:
    """``--lockstep``: ``auto``, ``on``, ``off``, ``column`` (one process for the runs of a column, whatever their
    rules) or N (groups of at most N runs)."""
    if text in ("auto", "on", "off", "column"):
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"`--lockstep` takes auto, on, off, column or a number of runs per group (>= 1), got "
                          f"{text!r}")
    return n


def decide(mode: int | str, launcher: str) -> tuple[int | None, str]:
    """The largest group (``None``: no limit, 1: no groups) and why, for ``--lockstep MODE``."""
    if mode == "off":
        return 1, "--lockstep off"
    if launcher != "local":
        check(mode == "auto", "`--lockstep` groups runs in local processes; with `--launcher slurm` use `--lockstep "
              "off` (or auto)")
        return 1, "--launcher slurm: one job per run"
    if mode != "auto":
        return (None if mode in ("on", "column") else int(mode)), f"--lockstep {mode}"
    if not _cuda():
        return 1, ("auto: off on CPU, where a group trains no faster than its runs one by one (results/performance.md "
                   "§12); `--lockstep on` groups them anyway (one process per group)")
    return None, "auto: on a GPU"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def group(runs: list[Run], spec: dict[str, Any], limit: int | None, by_rule: bool = True) -> list[Any]:
    """``runs`` with those that can share a chunk replaced by :class:`Group` s of at most ``limit`` runs.

    ``by_rule=False`` (``--lockstep column``): the runs of a column in one process whatever their local rules; the
    group trains what shares a chunk together and the rest one union after another, on one GPU context. (In the H200
    window of 2026-11-28 seven lockstep processes, one per rule, together made about the client steps per second of
    one run alone, as processes taking turns on the card would; results/gpu_window_2026-11-28_lockstep.md.)"""
    distinct = list({r.path: r for r in runs}.values())
    if limit == 1:
        return distinct
    keyed: dict[Any, list[Run]] = {}
    for r in distinct:
        keyed.setdefault(_key(r, spec, by_rule), []).append(r)
    out: list[Any] = []
    for members in keyed.values():
        step = limit or len(members)
        for i in range(0, len(members), step):
            part = members[i : i + step]
            out.append(part[0] if len(part) == 1 else Group(part))
    return out


def _key(run: Run, spec: dict[str, Any], by_rule: bool = True) -> tuple:
    """What runs of one group agree on: every flag but the seed and the algorithm, and (``by_rule``) the algorithm's
    local rule."""
    fl = run.record["flags"]
    pairs = [(fl[i], fl[i + 1]) for i in range(0, len(fl) - 1, 2) if fl[i] != "--seed"]
    rest = (tuple((k, v) for k, v in pairs if k != "--algorithm"), tuple(run.record.get("execution", [])))
    if not by_rule:
        return rest
    alg = next((json.loads(v) for k, v in pairs if k == "--algorithm"), None)
    return (*rest, _local_rule(alg if alg is not None else _base_alg(spec)))


def _base_alg(spec: dict[str, Any]) -> Any:
    import yaml

    return (yaml.safe_load(base_path(spec).read_text()) or {}).get("algorithm", "fedlight.algorithms.FedAvg")


def _local_rule(alg: Any) -> Any:
    """The local rule of an algorithm spec, described (its type and settings); the spec itself if it cannot be
    built here."""
    from fedlight.core.spec import build
    from fedlight.engine.lockstep import describe

    try:
        built = build(alg) if not isinstance(alg, str) or "." in alg else None
        return describe(built.local) if built is not None else alg
    except Exception:  # noqa: BLE001 - a spec only `fedlight fit` can build: a group of its own
        return json.dumps(alg, sort_keys=True)


@dataclass
class Group:
    """Runs trained in one ``fedlight lockstep`` process; a unit of :func:`fedlight.lab.tables.runner.run_all`."""

    runs: list[Run]

    @property
    def path(self) -> Path:
        return self.runs[0].path

    @property
    def seed(self) -> int:
        return min(r.seed for r in self.runs)

    @property
    def label(self) -> str:
        return f"lockstep group of {len(self.runs)} ({', '.join(r.label for r in self.runs)})"

    def valid(self) -> bool:
        return any(r.valid() for r in self.runs)

    def finished(self) -> bool:
        return all(r.finished() or not r.valid() for r in self.runs)

    def rounds(self) -> int:
        return sum(r.rounds() for r in self.runs)

    @staticmethod
    def command(runs: list[Run]) -> list[str]:
        """``fedlight lockstep`` arguments training ``runs``: their ``fit`` flags, ``::``-separated."""
        argv = ["lockstep"]
        for r in runs:
            argv += [*(["::"] if len(argv) > 1 else []), *r.argv[1:]]  # r.argv: fit FLAGS
        return argv

    @property
    def argv(self) -> list[str]:
        return self.command(self.runs)

    def execute(self, env: dict, call) -> list[tuple[Run, str]]:
        """Run the group's runs still to do in one process: each run's outcome."""
        from fedlight.lab.tables import jobs
        from fedlight.run.files import atomic_write_text

        status = {id(r): "conflict" for r in self.runs if not r.valid()}
        status.update((id(r), "skipped") for r in self.runs if r.valid() and r.finished())
        todo = [r for r in self.runs if id(r) not in status]
        for r in todo:
            r.path.mkdir(parents=True, exist_ok=True)
            atomic_write_text(r.path / "reproduce.json", json.dumps(r.record, indent=1) + "\n")
            jobs.mark(r.path, state="running", pid=os.getpid(), host=jobs.host())
        if todo:
            log = todo[0].path / "fit.log"
            start = log.stat().st_size if log.is_file() else 0
            with open(log, "a") as f:
                rc = call([sys.executable, "-m", "fedlight.config.cli", *self.command(todo)], stdout=f, stderr=f,
                          env=env)
            text = log.read_bytes()[start:]
        for r in todo:
            if r is not todo[0]:  # every run folder keeps the log of what trained it
                with open(r.path / "fit.log", "ab") as f:
                    f.write(text)
            status[id(r)] = "stopped" if rc is None else r.outcome(0 if r.finished() else rc)
            jobs.mark(r.path, state=status[id(r)], rc=rc)
        return [(r, status[id(r)]) for r in self.runs]
