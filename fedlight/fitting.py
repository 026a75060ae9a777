"""Fitting: the run from round to round — evaluate, checkpoint, resume, finish — around
:meth:`FederatedLoop.run_round <fedlight.loop.FederatedLoop.run_round>`.

Kept apart from the round itself: the round plans, trains and reduces; this part decides when to evaluate and to
checkpoint, and hands rows and checkpoint snapshots to the :class:`~fedlight.run.record.RunRecord`, which owns every
file of the run directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from fedlight import params as P
from fedlight.errors import ConfigError
from fedlight.run import stops
from fedlight.run.files import (
    atomic_torch_save,
    cpu_copy,
    fault,
    load_checkpoint,
    meta_differences,
    rss_mb,
    summarize,
    to_device,
)
from fedlight.run.record import RunRecord


class Diverged(RuntimeError):
    """Training produced a non-finite loss, update or model (``loop.on_nonfinite: stop``)."""

    def __init__(self, round: int, what: str) -> None:
        super().__init__(f"round {round + 1}: {what}")
        self.round = round


class Fitting:
    """The round-to-round half of :class:`~fedlight.loop.FederatedLoop` (a mixin over its attributes)."""

    # ----------------------------------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """The task's test metrics of the global model (test batches strided over ranks)."""
        P.copy_(self.live, self.x)
        P.copy_(self.live_buffers, self.buffers)
        ws, rank = self.fabric.world_size, self.fabric.global_rank
        mine = (b for j, b in enumerate(self.data.test_batches())
                if j % ws == rank and not fault("eval", self._round_done + 1))
        return self.task.evaluate(self.model, mine, self.fabric)

    def probe(self) -> None:
        """One training batch (client 0) and one test batch through model + task, changing nothing: a model that
        does not fit the data or the task is refused here, before round 1, with the fix."""
        gen = torch.Generator().manual_seed(self.seed)
        train = next(iter(self.data.client_batches(0, 1, gen)))
        test = next(iter(self.data.test_batches()), train)
        self.task.probe(self.model, train, test, self.data, self.fabric)

    # ----------------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self, rounds_done: int) -> dict[str, Any]:
        """Everything a resume needs, as private CPU copies (safe to write while the next round runs)."""
        return {
            "format": 1,
            "round": rounds_done,
            "params": cpu_copy(self.x),
            "buffers": cpu_copy(self.buffers),
            "int_buffers": cpu_copy(self.int_buffers),
            "server": cpu_copy(self.server.state_dict()),
            "store": self.store.state_dict(),  # states are replaced on put, never changed in place
            "totals": dict(self.totals),
            "meta": self.meta(),
        }

    def meta(self) -> dict[str, Any]:
        return {"algorithm": getattr(self.algorithm, "name", type(self.algorithm).__name__),
                "model": type(self.model).__name__,
                "shapes": {k: list(v.shape) for k, v in self.x.items()},
                "num_clients": self.data.num_clients, "seed": self.seed}

    def save(self, rounds_done: int, row: dict[str, Any] | None = None) -> None:
        """Write ``checkpoints/last.ckpt`` now (synchronously; :meth:`fit` writes in the background)."""
        if self.fabric.global_rank == 0:
            state = self.checkpoint_state(rounds_done)
            state["last_row"] = json.dumps(row) if row is not None else None
            atomic_torch_save(state, self.out_dir / "checkpoints" / "last.ckpt")
        self.fabric.barrier()

    def load(self, ckpt: Path | dict[str, Any]) -> None:
        """Continue from a checkpoint (a path, or one already loaded); refuses one of another run."""
        path = ckpt if not isinstance(ckpt, dict) else "(given)"
        ckpt = load_checkpoint(ckpt, map_location=self.device) if not isinstance(ckpt, dict) else ckpt
        problems = meta_differences(ckpt["meta"], self.meta())
        if problems:
            raise ConfigError(f"`resume` checkpoint {path} does not match this run: {'; '.join(problems)}")
        self.x = {k: v.to(self.device) for k, v in ckpt["params"].items()}
        self.buffers = {k: v.to(self.device) for k, v in ckpt["buffers"].items()}
        for k, v in ckpt["int_buffers"].items():
            self.int_buffers[k].copy_(v)
        self.server.load_state_dict(to_device(ckpt["server"], self.device))
        self.store.load_state_dict(ckpt["store"])
        self.totals = dict(ckpt["totals"])
        self.start_round = int(ckpt["round"])
        self._last_row = json.loads(ckpt["last_row"]) if ckpt.get("last_row") else None

    # ----------------------------------------------------------------------------------------- fit
    def fit(self, record: RunRecord | None = None) -> dict[str, Any]:
        """Run the remaining rounds: train → evaluate → hand the row and (every ``save_every`` rounds) a checkpoint
        snapshot to the run record, which writes them in the background (see :mod:`fedlight.run.record`)."""
        cfg, fabric = self.cfg, self.fabric
        own = record is None
        if own:
            record = RunRecord(self.out_dir, rank0=fabric.global_rank == 0, rounds=cfg.rounds, progress=cfg.progress)
            record.open(None, tensorboard=False, fresh=False)
        try:
            record.progress.key = self.task.headline_key
            record.begin(self.start_round, self._last_row)
            fabric.print(f"fedlight: client runner: {self.runner.name} ({self.runner_reason})")
            t_fit, wall0 = time.perf_counter(), self.totals["wall_time_s"]
            for r in range(self.start_round, cfg.rounds):
                row = self._fit_round(r, record)
                if row is None:
                    break
                if r == self.start_round:
                    row["warm_up"] = True  # compilation, autotuning, allocator: not in seconds_per_round
                self.totals["bytes_up"] += row["bytes_up"]
                self.totals["bytes_down"] += row["bytes_down"]
                self.totals["wall_time_s"] = wall0 + time.perf_counter() - t_fit
                row["rss_mb"] = rss_mb()
                snapshot = None
                stop = stops.agreed(fabric) if r + 1 < cfg.rounds else None  # SIGTERM, SIGINT, SIGUSR1
                if ((r + 1) % cfg.save_every == 0 or r + 1 == cfg.rounds or stop) and fabric.global_rank == 0:
                    t = time.perf_counter()
                    record.flush()  # the previous checkpoint is durable before the store drops files it named
                    snapshot = self.checkpoint_state(r + 1)
                    row["checkpoint_time_s"] = time.perf_counter() - t  # on the critical path: wait + snapshot
                record.round_done(row, snapshot)
                if stop:
                    stops.stop_here(record, r + 1, stop)  # raises stops.Stopped once the row and checkpoint are on disk
            return self.finish(record)
        finally:
            if own:
                record.close()

    def _fit_round(self, r: int, record: RunRecord) -> dict[str, Any] | None:
        """Train and (when due) evaluate round ``r``; ``None`` when it diverged."""
        self._round_done = r
        record.phase("training", r)
        try:
            row = self.run_round(r)
        except Diverged as d:
            self.diverged_at = d.round + 1
            self.fabric.print(f"fedlight: stopped, diverged in {d}; the last good checkpoint is kept")
            return None
        if (r + 1) % self.cfg.eval_every == 0 or r + 1 == self.cfg.rounds:
            record.phase("evaluating", r)
            t = time.perf_counter()
            row.update(self.evaluate())
            row["eval_time_s"] = time.perf_counter() - t
        return row

    def finish(self, record: RunRecord) -> dict[str, Any]:
        """Write final_model.pt and summary.json from the global model and the record's rows."""
        record.flush()
        summary = summarize(record.rows, self.cfg.targets, self.totals,
                            (self.task.headline_key, self.task.higher_is_better))
        if self.diverged_at is not None:
            summary["diverged_at_round"] = self.diverged_at
        summary["client_runner"] = f"{getattr(self.runner, 'description', self.runner.name)} ({self.runner_reason})"
        summary["client_runner_fallbacks"] = list(getattr(self.runner, "fallbacks", []))
        summary.update(record.summary_extra())
        if self.task.effective:
            summary["local_optimization"] = self.task.effective
        state = None
        if self.fabric.global_rank == 0:
            P.copy_(self.live, self.x)
            P.copy_(self.live_buffers, self.buffers)
            state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        record.finish(summary, state)
        self.task.end(self.model)
        self.fabric.barrier()
        return summary
