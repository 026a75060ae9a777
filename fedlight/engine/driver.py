"""FitDriver: the run from round to round — prepare, probe, evaluate, stop, checkpoint, resume, finish — around
:meth:`FederatedLoop.run_round <fedlight.engine.loop.FederatedLoop.run_round>`.

Composition, not inheritance: the driver holds the loop (which advances the
:class:`~fedlight.engine.loop_state.LoopState`
one round) and the :class:`~fedlight.run.record.RunRecord` (which owns every file of the run directory). It
decides when to evaluate and to checkpoint and hands the record rows and state snapshots (the state is the only
author of a checkpoint, the record writes its bytes); a resume is checked once (:meth:`FitDriver.resume`) and
restores the state the checkpoint holds. A run reads :meth:`FitDriver.prepare` → :meth:`FitDriver.fit` →
:meth:`FitDriver.finish`.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch

from fedlight.core.loop_config import LoopConfig
from fedlight.core.rules import Algorithm
from fedlight.engine.loop import Diverged, FederatedLoop
from fedlight.engine.loop_state import key_problem, resume_problems
from fedlight.engine.work import Evaluation, Work, drive
from fedlight.errors import ConfigError, check
from fedlight.run import stops, study_gate
from fedlight.run.atomic import atomic_torch_save
from fedlight.run.files import fault, is_fraction, rss_mb, summarize
from fedlight.run.record import RunRecord
from fedlight.tasks import Task, resolve_task

__all__ = ["Diverged", "FitDriver"]


class FitDriver:
    """Fits ``loop`` to ``loop.cfg.rounds`` rounds, writing through ``record``.

    Args:
        loop: the federated loop (its :attr:`~fedlight.engine.loop.FederatedLoop.state` is what is checkpointed).
        record: the run record, opened (needed by :meth:`fit` only).
    """

    def __init__(self, loop: FederatedLoop, record: RunRecord | None = None) -> None:
        self.loop, self.record = loop, record
        self.diverged_at: int | None = None
        self.trained_by: dict[str, Any] | None = None  # the client runner of this process's last round

    @classmethod
    def prepare(cls, fabric, model, data, algorithm: Algorithm, cfg: LoopConfig, seed: int, out_dir: Path,
                task: Task | None = None, record: RunRecord | None = None, *,
                resume: tuple[dict[str, Any], Path] | None = None, settings: dict[str, Any] | None = None,
                execution: dict[str, Any] | None = None) -> FitDriver:
        """Everything before round 1 that may refuse the run, before any file is written: the task (resolved with
        the set-up ``data``), its local optimization, the loop, the probe of one batch, the targets, the client
        states' folder, the resume (``(checkpoint, path)``: checked against the run and its defining ``settings``,
        then restored) and the run segment of the ``execution`` settings."""
        task = resolve_task(task, model, data)  # set up by the loop, with the data
        if hasattr(task, "record"):  # a LightningModule's self.logger writes the run's TensorBoard
            task.record = record
        cfg, optimizer, algorithm = local_optimization(fabric, model, task, algorithm, cfg, data)
        driver = cls(FederatedLoop(fabric, model, data, algorithm, cfg, seed, out_dir, task, optimizer), record)
        driver.probe()  # one batch through model + task: a mismatch is refused before round 1
        check_targets(task, cfg)  # after the probe: a LightningModule's headline is known only then
        loop, state = driver.loop, driver.loop.state
        loop.store.use_folder(loop.state_folder, root=out_dir)  # unchanged states are never rewritten there
        if resume is not None:
            loop.store.read_from(Path(resume[1]).parent.parent)  # the files a checkpoint names: in its run directory
            driver.resume(*resume, settings)
        if settings is not None:
            state.settings = settings
        state.begin_segment(execution or {})
        if record is not None:  # the optimizer really used names the likely cause of an exploding loss
            record.watch.hint = getattr(task, "hint", None) or record.watch.hint
        return driver

    @property
    def task(self) -> Task:
        return self.loop.task

    @property
    def algorithm(self) -> Algorithm:
        """The rule pair that trains (a task's own local optimization may have replaced the given one's)."""
        return self.loop.algorithm

    @property
    def cfg(self) -> LoopConfig:
        """The loop settings that train (a task's own local optimization may have rewritten the given ones)."""
        return self.loop.cfg

    has_test = True
    """Whether the data yields a test batch (:meth:`probe` looks)."""

    # ----------------------------------------------------------------------------------------- checks
    def probe(self) -> None:
        """One training batch (client 0) and one test batch through model + task, changing nothing: a model that
        does not fit the data or the task is refused here, before round 1, with the fix."""
        loop = self.loop
        gen = torch.Generator().manual_seed(loop.seed)
        train = next(iter(loop.data.client_batches(0, 1, gen)))
        test = next(iter(loop.data.test_batches()), None)
        self.has_test = test is not None  # else nothing is evaluated (said at the start)
        loop.task.probe(loop.model, train, train if test is None else test, loop.data, loop.fabric)

    def resume(self, ckpt: dict[str, Any], path: Path | str, settings: dict[str, Any] | None = None) -> None:
        """Continue from a loaded checkpoint; one of another run (model, clients, seed, or defining ``settings``)
        is refused with every difference, one with keys a checkpoint does not have with their names."""
        problem = key_problem(ckpt)
        if problem:
            raise ConfigError(f"`resume` checkpoint {path} {problem}")
        problems = resume_problems(ckpt, self.loop.state.meta, settings)
        if problems:
            raise ConfigError(f"`resume` checkpoint {path} does not match this run: {'; '.join(problems)}. "
                              "Resume with the settings it was trained with, or start a new run (another "
                              "`--out_dir`, or `--overwrite true` without `--resume`)")
        self.loop.state.restore(ckpt, self.loop.device)

    # ----------------------------------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """The task's test metrics of the global model (test batches strided over ranks)."""
        loop = self.loop
        loop.load_global()
        fault("eval", loop.state.rounds_done)  # the kill-safety tests stop the run here
        if not self.has_test:
            return {}  # no test set: nothing measured (said at the start), not a NaN loss and 0 % accuracy
        ws, rank = loop.fabric.world_size, loop.fabric.global_rank
        mine = (b for j, b in enumerate(loop.data.test_batches()) if j % ws == rank)
        return loop.task.evaluate(loop.model, mine, loop.fabric)

    # ----------------------------------------------------------------------------------------- fit
    def fit(self) -> None:
        """Run the remaining rounds: train → evaluate → hand the row (the state's last row, completed here) and
        (every ``save_every`` rounds) a checkpoint snapshot to the run record, which writes them in the background
        (see :mod:`fedlight.run.record`)."""
        drive(self.fit_steps())

    def fit_steps(self) -> Generator[Work, Any, None]:
        """:meth:`fit`, yielding each round's :class:`~fedlight.engine.work.Work` to whoever trains it."""
        loop, record, state = self.loop, self.record, self.loop.state
        record.progress.key = loop.task.headline_key
        start = state.rounds_done
        record.begin(start, state.last_row)
        if start < loop.cfg.rounds:
            loop.fabric.print(f"fedlight: client runner: {loop.runner.name} ({loop.runner_reason})")
            if not self.has_test:
                loop.fabric.print("fedlight: note: the data has no test set: nothing is evaluated (no test metrics)")
        for r in range(start, loop.cfg.rounds):
            row = yield from self._fit_round(r)
            if row is None:
                break
            if r == start:
                row["warm_up"] = True  # compilation, autotuning, allocator: not in seconds_per_round
            row["rss_mb"] = rss_mb()
            self.trained_by = self._runner()  # this process's runner trained a round
            if state.segments:  # kept with the stretch of the run in the checkpoint, for a finishing pass
                state.segments[-1].update(self.trained_by)
            self._record(row)

    def _fit_round(self, r: int) -> Generator[Work, Any, dict[str, Any] | None]:
        """Train and (when due) evaluate round ``r``; ``None`` when it diverged."""
        loop = self.loop
        self.record.phase("training", r)
        try:
            row = yield from loop.round_steps(r)
        except Diverged as d:
            self.diverged_at = d.round + 1
            loop.fabric.print(f"fedlight: stopped, diverged in {d}; the last good checkpoint is kept")
            return None
        if (r + 1) % loop.cfg.eval_every == 0 or r + 1 == loop.cfg.rounds:
            self.record.phase("evaluating", r)
            t = time.perf_counter()
            row.update((yield Evaluation(self)))
            row["eval_time_s"] = time.perf_counter() - t
        return row

    def _record(self, row: dict[str, Any]) -> None:
        """Hand the round's row, and its checkpoint when due, to the record; stop here on an agreed signal."""
        loop, record, done = self.loop, self.record, self.loop.state.rounds_done
        rounds, fabric = loop.cfg.rounds, loop.fabric
        stop = stops.agreed(fabric) if done < rounds else None  # SIGTERM, SIGINT, SIGUSR1
        ask = stop is None and done < rounds and study_gate.asks(row)  # fedlight tune: may the run go on?
        snapshot = None
        if (done % loop.cfg.save_every == 0 or done == rounds or stop or ask) and fabric.global_rank == 0:
            t = time.perf_counter()
            record.flush()  # the previous checkpoint is durable before the store drops files it named
            snapshot = loop.state.snapshot()
            row["checkpoint_time_s"] = time.perf_counter() - t  # on the critical path: wait + snapshot
        record.round_done(row, snapshot)
        if ask:  # the row on disk, where the study reads it; then its answer, before the next round
            record.flush()
            stop = study_gate.wait(done, stops.requested) or stops.agreed(fabric)
        if stop:
            stops.stop_here(record, done, stop)  # raises stops.Stopped once the row and checkpoint are on disk

    def _runner(self) -> dict[str, Any]:
        """The client runner as it trained this round: its description, why it was chosen, its fallbacks so far."""
        loop = self.loop
        runner = loop.runner
        return {"client_runner": f"{getattr(runner, 'description', runner.name)} ({loop.runner_reason})",
                "client_runner_fallbacks": list(getattr(runner, "fallbacks", []))}

    def finish(self) -> dict[str, Any]:
        """Write final_model.pt and summary.json from the global model and the record's rows."""
        loop, record = self.loop, self.record
        record.flush()
        task = loop.task
        summary = summarize(record.rows, loop.cfg.targets, loop.state.totals_now(),
                            (task.headline_key, task.higher_is_better))
        summary["run_id"] = loop.state.run_id  # config.yaml and the checkpoints carry it too (fedlight verify)
        summary["metric_directions"] = task.directions()  # what `fedlight report` reads a best_ value by
        if self.diverged_at is not None:
            summary["diverged_at_round"] = self.diverged_at
        trained = self.trained_by or next((s for s in reversed(loop.state.segments) if "client_runner" in s), None)
        if trained is not None:  # never a runner that trained no round (a finishing pass trains none)
            summary.update({k: trained[k] for k in ("client_runner", "client_runner_fallbacks")})
        if loop.state.segments:
            summary["segments"] = loop.state.segments
        if task.effective:
            summary["local_optimization"] = task.effective
        if hasattr(loop.server, "summary"):  # a private run (fedlight.privacy): ε, δ, σ, C, q, rounds, accountant
            summary["privacy"] = loop.server.summary()
        state = None
        if loop.fabric.global_rank == 0:
            loop.load_global()
            state = {k: v.detach().cpu().clone() for k, v in loop.model.state_dict().items()}
        record.finish(summary, state)
        if state is not None:  # global rank 0
            for name, obj in task.final_files(loop.model).items():
                atomic_torch_save(obj, record.out / name)
        task.end(loop.model)
        loop.fabric.barrier()
        return summary


def check_targets(task: Task, cfg: LoopConfig) -> None:
    if is_fraction(task.headline_key):
        check(all(0 < t <= 1 for t in cfg.targets), f"`loop.targets` are values of {task.headline_key}, a fraction: "
              f"they must be in (0, 1], got {cfg.targets} (write 0.7 for 70 %)")


def local_optimization(fabric, model, task, algorithm, cfg, data=None):
    """The task's own local optimization (:meth:`~fedlight.tasks.Task.local_optimization`: a LightningModule's
    ``configure_optimizers``, schedulers and clip, see :mod:`fedlight.tasks.lightning.optim`; else the loop's):
    ``(cfg, optimizer factory or None, algorithm)``."""
    local = task.local_optimization(fabric, model, algorithm, cfg, data)
    return local.loop, local.optimizer, local.algorithm
