"""``fit``: the Python entry point. Its typed signature is the recipe schema (the CLI is generated from it).

``fit`` resolves a :class:`~fedlight.config.plan.Plan` (model, data, rule, task, settings, run directory; then the
checkpoint to resume), builds the engine — :class:`~fedlight.engine.loop.FederatedLoop` inside a
:class:`~fedlight.engine.driver.FitDriver` — refuses what does not fit before any file is written, and runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from typing import Any

import torch
from torch import nn

from fedlight.config import resume as resumes
from fedlight.config import settings as recorded
from fedlight.config.plan import Plan, check_clients, resolve_plan
from fedlight.core.loop_config import LoopConfig
from fedlight.core.rules import Algorithm
from fedlight.data import FederatedDataModule
from fedlight.data.augment import adopt_preprocessing
from fedlight.data.mapstyle import DataModuleLike
from fedlight.engine.work import Evaluation, Work, drive
from fedlight.errors import ConfigError
from fedlight.privacy.record import uses_per_round
from fedlight.privacy.settings import PrivacyConfig
from fedlight.privacy.wrap import check_model, private
from fedlight.run import stops, tracker_entries, trackers
from fedlight.run.directory import snapshot
from fedlight.run.faults import fault
from fedlight.run.record import RunRecord
from fedlight.tasks import Task


def fit(
    model: nn.Module,
    data: FederatedDataModule | DataModuleLike | None = None,
    algorithm: Algorithm | None = None,
    loop: LoopConfig = LoopConfig(),  # noqa: B008 - a frozen-by-convention default; jsonargparse reads it
    seed: int = 0,
    out_dir: str | None = None,
    accelerator: str = "auto",
    devices: int = 1,
    num_nodes: int = 1,
    precision: str | None = None,
    resume: str | None = None,
    overwrite: bool = False,
    task: Task | None = None,
    loggers: list | dict | str | None = "tensorboard",
    privacy: PrivacyConfig | None = None,
    _config_text: str | None = None,
) -> dict[str, Any]:
    """Train ``model`` federatedly with ``algorithm`` on ``data`` and write the run record to ``out_dir``.

    Args:
        model: the network: a plain ``nn.Module`` (e.g. ``fedlight.models.ResNet18``) or a ``LightningModule``, whose
            ``training_step`` is then the client objective, ``test_step`` (else ``validation_step``) with
            ``self.log`` the evaluation and ``configure_optimizers`` the local optimizer (unless the rule brings
            its own). From Python it may also be a class-path spec ``{"class_path": ..., "init_args": {...}}``:
            ``fit`` then builds it after ``torch.manual_seed(seed)`` (as the CLI does) and records it in
            ``config.yaml``.
        data: a federated data module: dataset + partition (e.g. ``fedlight.data.CIFAR10``), or a
            ``LightningDataModule`` (wrapped in :class:`fedlight.data.DataModuleClients`, which chooses clients and
            partition); ``None``: a LightningModule's own dataloaders.
        algorithm: the federated rule pair (e.g. ``fedlight.algorithms.FedNSAM``); default FedAvg.
        loop: rounds, sampling, local steps, optimizer, schedule, evaluation and checkpoint settings.
        seed: every random stream (sampling, data order, augmentation, init) derives from it.
        out_dir: run directory; default ``runs/<algorithm>_<model>_<data>_s<seed>-<hash>``, the hash taken over the
            settings that define the run (so runs that differ never share a directory). Locked while a run uses it.
        accelerator: ``cpu``, ``cuda``, ``gpu`` or ``auto``.
        devices: processes per node (client-parallel; ``ddp`` launcher, gloo on CPU, nccl on GPU).
        num_nodes: machines, through Fabric's launcher.
        precision: ``32-true`` (CPU default), ``bf16-mixed`` (GPU default), ``64-true``, ``bf16-true``, ``16-mixed``.
        resume: ``auto`` (continue from ``out_dir/checkpoints/last.ckpt`` when it exists) or a checkpoint path. A
            checkpoint whose defining settings differ from this run's is refused with the list of differences;
            execution-only settings (devices, parallelism, checkpoint cadence, ...; see
            :mod:`fedlight.run.directory`) may change and are recorded per segment in ``summary.json``.
        overwrite: start over in an existing, non-empty run directory.
        task: what the model is trained and evaluated for (:mod:`fedlight.tasks`: ``Classification``,
            ``Regression``, ``TextClassification``, ``LanguageModeling``); default: a LightningModule's own,
            else the data module's (classification for fedlight's datasets).
        loggers: see docs/trackers.md.
        privacy: differential privacy: docs/privacy.md.

    Returns:
        The summary (also written to ``out_dir/summary.json``).

    Raises:
        fedlight.run.stops.Stopped: ``SIGTERM``, ``SIGINT`` or ``SIGUSR1`` arrived; the run stopped after the round in
            progress with that round's checkpoint on disk (``--resume auto`` continues it).
        fedlight.run.stops.RunDirError: a write to ``out_dir`` failed during the run; the message names the file and
            the last complete checkpoint.
    """
    return drive(fit_steps(dict(locals())))


def fit_steps(args: dict[str, Any], fabric=None) -> Generator[Work | Evaluation, Any, dict[str, Any]]:
    """:func:`fit` (``args``: its arguments by name) as a generator of its rounds' work (:mod:`fedlight.engine.work`;
    a lockstep group, :mod:`fedlight.engine.lockstep`, drives several); ``fabric``: a launched one to share."""
    a = args
    plan = resolve_plan(a["model"], a.get("data"), a.get("algorithm"), a.get("loop", LoopConfig()), a.get("seed", 0),
                        a.get("out_dir"), a.get("accelerator", "auto"), a.get("precision"), a.get("task"),
                        a.get("_config_text"), (a.get("devices", 1), a.get("num_nodes", 1)), a.get("privacy"))
    plan.trackers = tracker_entries.parse(a.get("loggers", "tensorboard"))  # a bad entry or missing package: exit 2
    plan.before = snapshot(plan.out)  # what the start decision reads, compared again under the lock
    plan.ckpt_path, plan.ckpt, plan.clear = resumes.start(plan.out, a.get("resume"), a.get("overwrite", False),
                                                          plan.defining, plan.loop.rounds)
    if (done := resumes.finished(plan, a.get("overwrite", False))) is not None:
        return done  # said in one line; nothing trained, nothing written
    from fedlight.config import launch

    fabric = fabric or launch.fabric(plan.accelerator, a.get("devices", 1), a.get("num_nodes", 1), plan.precision)
    record = _record(fabric, plan)
    refused, agreed = True, False
    try:
        driver = _prepare(fabric, plan, record)
        _annotate(record, driver, plan)
        refused = False
        try:
            summary = yield from _train(driver, record, plan)
        except stops.Stopped:
            agreed = True  # every process stops after the same round
            raise
        agreed = True
        return summary
    except Exception as e:  # the user's own code (a LightningModule's hook) raised mid-run: its frames, what is kept;
        # a failure in fedlight's own code: a fedlight line before the traceback
        from fedlight.tasks.lightning.errors import internal_error_line, passes_user_code, user_code_error

        said = isinstance(e, (ConfigError, stops.Stopped, stops.StoppedAtStart))  # fedlight's own lines
        if refused or (mine := user_code_error(e, record)) is None:
            if not said and not passes_user_code(e):  # a failure in fedlight's code: one fedlight line with it
                print(internal_error_line(e, record), file=sys.stderr)  # (the traceback follows)
            raise
        raise mine from None
    finally:
        record.close(refused=refused, failing=sys.exc_info()[0] is not None)
        stops.end_processes(fabric, agreed)


def _record(fabric, plan: Plan) -> RunRecord:
    """The run record, its directory locked by this run (every process agrees)."""
    from fedlight.config import launch

    record = RunRecord(plan.out, rank0=fabric.global_rank == 0, rounds=plan.loop.rounds, progress=plan.loop.progress,
                       hint=recorded.lr_hint(plan.algorithm, plan.loop, plan.privacy))
    record.tensorboard = plan.trackers[0]
    record.rotate = plan.ckpt_path is None or plan.ckpt_path.name != "prev.ckpt"  # else last.ckpt is damaged
    launch.agree(fabric, lambda: record.acquire(plan.before))
    if plan.clear == "reuse":  # said once the directory is ours (a run refused by the lock replaces nothing)
        resumes.note(f"{plan.out} holds a run that finished no round; reusing it (its files are replaced)")
    return record


def _train(driver, record: RunRecord, plan: Plan) -> Generator[Work | Evaluation, Any, dict[str, Any]]:
    """Open the run's files, run the rounds and finish: a failed write is one message (exit 74), a stop signal a
    clean stop."""
    effective = driver.task.effective  # what trained, where the loop settings do not apply
    text = plan.text + (f"# fedlight: local optimization used: {effective}\n" if effective else "")
    from fedlight.config import launch

    with stops.disk_guard(record):
        fresh = plan.ckpt is None or resumes.config_damaged(plan.out, plan.ckpt)  # a damaged one is rewritten
        record.open(text, plan.data, overwrite=bool(plan.clear) and plan.ckpt is None, fresh=fresh,
                    tensorboard=plan.trackers[0], run_id=driver.loop.state.run_id)
        launch.agree(driver.loop.fabric, lambda: _start_trackers(record, driver, plan, text))  # before round 1
        with stops.stop_signals():
            yield from driver.fit_steps()
            return driver.finish()


def _start_trackers(record: RunRecord, driver, plan: Plan, text: str) -> None:
    """Reach the trackers asked for (global rank 0): an unreachable one refuses the run before round 1."""
    if not plan.trackers[1] or not record.rank0:
        return
    tags = tracker_entries.run_tags(driver.algorithm, plan.model, plan.data, plan.seed, plan.out)
    record.trackers = trackers.Trackers(plan.trackers[1], plan.out, tags, text, resumed=plan.ckpt is not None)
    record.trackers.start()


def _annotate(record: RunRecord, driver, plan: Plan) -> None:
    """TensorBoard's hyperparameters (of the rule and loop settings that train) and the run directory's name."""
    record.hparams = recorded.hparams(driver.algorithm, driver.cfg, plan.seed)
    if record.rank0:
        print(f"fedlight: run directory {record.out}", file=sys.stderr, flush=True)


def _prepare(fabric, plan: Plan, record: RunRecord):
    """The data, set up, then the driver (:meth:`FitDriver.prepare`: task, local optimization, loop, probe, resume):
    everything that may refuse the run, before any file is written."""
    data = plan.data
    _lightning_data(fabric, plan.model, data)
    data.input_dtype = torch.float64 if plan.precision == "64-true" else torch.float32  # float64 data stays float64
    if (note := adopt_preprocessing(plan.model, data)) is not None:  # a pretrained model's mean/std, interpolation
        fabric.print(f"fedlight: {note}")
    with fabric.rank_zero_first():
        data.setup(fabric.device, plan.seed)
    fault("setup", 0)
    check_clients(plan.loop, data.num_clients)
    from fedlight.engine.driver import FitDriver

    algorithm = plan.algorithm
    if plan.privacy is not None:  # after data.setup: N is known; σ calibrated (and printed) here, before round 1
        uses = uses_per_round(data, plan.loop) if plan.privacy.level == "record" else 1
        check_model(plan.model, plan.privacy, plan.precision, plan.loop.aggregate_buffers)
        algorithm = private(algorithm, plan.privacy, plan.seed, data.num_clients, plan.loop.clients_per_round,
                            plan.loop.rounds, uses, plan.loop.sampling, plan.loop.on_nonfinite,
                            resumed=plan.ckpt is not None)
    return FitDriver.prepare(fabric, plan.model, data, algorithm, plan.loop, plan.seed, plan.out, plan.task,
                             record, resume=None if plan.ckpt is None else (plan.ckpt, plan.ckpt_path),
                             settings=plan.defining, execution=plan.execution)


def _lightning_data(fabric, model, data) -> None:
    """A LightningModule's own data hooks see the run's Fabric in ``setup``; a module with its own ``training_step``
    gets its batches as the loader yields them (string labels only split the clients)."""
    from fedlight.tasks.lightning.compat import is_lightning_module, overrides
    from fedlight.tasks.lightning.module_data import own_data

    if own_data(data):
        data.datamodule.fabric = fabric
    if hasattr(data, "map_labels") and is_lightning_module(model) and overrides(model, "training_step"):
        data.map_labels = False


