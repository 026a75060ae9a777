"""``fit``: the Python entry point. Its typed signature is the recipe schema (the CLI is generated from it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from torch import nn

from fedlight.args import LoopConfig
from fedlight.data import FederatedDataModule, as_federated
from fedlight.errors import ConfigError, check
from fedlight.rules import Algorithm
from fedlight.run import stops
from fedlight.run.directory import (
    LOCK_NAME,
    check_out_dir,
    differences,
    load_resume,
    settings_hash,
    split_settings,
)
from fedlight.run.faults import fault
from fedlight.run.files import check_metrics, load_checkpoint
from fedlight.run.record import RUN_FILES, RunRecord
from fedlight.spec import describe
from fedlight.tasks import Task

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed")


def fit(
    model: nn.Module,
    data: FederatedDataModule | LightningDataModule,
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
            ``LightningDataModule`` (wrapped in :class:`fedlight.data.DataModuleClients` with its defaults; wrap it
            yourself to choose the clients and the partition).
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

    Returns:
        The summary (also written to ``out_dir/summary.json``).

    Raises:
        fedlight.run.stops.Stopped: ``SIGTERM``, ``SIGINT`` or ``SIGUSR1`` arrived; the run stopped after the round in
            progress with that round's checkpoint on disk (``--resume auto`` continues it).
        fedlight.run.stops.RunDirError: a write to ``out_dir`` failed during the run; the message names the file and
            the last complete checkpoint.
    """
    algorithm = algorithm if algorithm is not None else _default_algorithm()
    data = as_federated(data)
    _check_args(algorithm, data, loop, devices, num_nodes)
    accelerator, precision = _resolve_device(accelerator, precision, algorithm)
    model, text = _model_and_config(model, data, algorithm, task, loop, seed, precision, _config_text)
    defining, execution = split_settings(_settings(text, precision))
    out = Path(out_dir) if out_dir else Path("runs") / f"{_default_name(algorithm, model, data, seed)}-" \
        f"{settings_hash(defining)}"
    ckpt_path, ckpt, overwrite = _checkpoint(out, resume, overwrite, defining)  # overwrite: True, False or "reuse"
    fabric = _fabric(accelerator, devices, num_nodes, precision)
    record = RunRecord(out, rank0=fabric.global_rank == 0, rounds=loop.rounds, progress=loop.progress,
                       hint=_lr_hint(algorithm, loop))
    record.rotate = ckpt_path is None or ckpt_path.name != "prev.ckpt"  # else last.ckpt is damaged: not kept
    _agree(fabric, record.acquire)
    if overwrite == "reuse":  # said once the directory is ours (a run refused by the lock replaces nothing)
        _note(f"{out} holds a run that finished no round; reusing it (its files are replaced)")
    refused, agreed = True, False
    try:
        runner = _prepare(fabric, model, data, algorithm, task, loop, seed, out, ckpt, ckpt_path, defining, precision)
        _annotate(record, runner, ckpt, defining, execution, seed)
        refused = False
        with stops.disk_guard(record):  # a failed write: one message, exit 74
            record.open(text, data, overwrite=overwrite and ckpt is None, fresh=ckpt is None)
            with stops.stop_signals():  # clean stops on signals
                try:
                    summary = runner.fit(record)
                except stops.Stopped:
                    agreed = True  # every process stops after the same round
                    raise
        agreed = True
        return summary
    finally:
        record.close(refused=refused)
        stops.end_processes(fabric, agreed)


def _checkpoint(out: Path, resume: str | None, overwrite: bool, defining: dict[str, Any]):
    """The checkpoint a resume continues from (path and contents; ``None`` for a fresh run), after checking that
    ``out`` may be used, and whether to clear it (a failed start's directory is reused)."""
    check_out_dir(out)
    ckpt_path, ckpt = load_resume(_resolve_resume(resume, out, defining), resume == "auto", _note)
    if ckpt is not None and ckpt_path.parent.parent.resolve() == out.resolve():
        last = json.loads(ckpt["last_row"]) if ckpt.get("last_row") else {}
        check_metrics(out / "metrics.jsonl", int(ckpt["round"]), last.get("round"))
    overwrite = _check_existing(out, resume, overwrite)
    return ckpt_path, ckpt, overwrite


def _annotate(record: RunRecord, runner, ckpt, defining: dict[str, Any], execution: dict[str, Any], seed: int) -> None:
    """What the run record adds to the summary: settings, segments, hyperparameters."""
    record.extra = {"settings": json.dumps(defining, default=str)}
    record.segments = _segments(ckpt, runner.start_round if ckpt else 0, execution)
    record.hparams = _hparams(runner.algorithm, runner.cfg, seed)
    if runner.fabric.global_rank == 0:
        print(f"fedlight: run directory {record.out}", file=sys.stderr, flush=True)


def _resolve_device(accelerator: str, precision: str | None, algorithm) -> tuple[str, str]:
    import torch

    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if precision is None:
        precision = "32-true" if accelerator == "cpu" else "bf16-mixed"
    check(precision in PRECISIONS, f"`precision` must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "16-mixed" and algorithm.local.needs_true_grad_norm:
        raise ConfigError(f"`precision: 16-mixed` is refused by {type(algorithm).__name__}: it takes gradient norms, "
                          "which fp16 loss scaling distorts. Use `--precision bf16-mixed` or `32-true`")
    return accelerator, precision


def _model_and_config(model, data, algorithm, task, loop, seed, precision, text):
    """The model (built here, after seeding, when given as a class-path spec, as the CLI builds it) and the
    resolved config text (described from the objects for a Python-API run)."""
    spec = None
    if isinstance(model, (dict, str)):
        import torch

        from fedlight.spec import build

        spec = {"class_path": model} if isinstance(model, str) else model
        torch.manual_seed(seed)
        model = build(spec)
    if text is None:
        text = _describe(model, data, algorithm, task, loop, seed, precision=precision, model_spec=spec)
        if spec is None and "init_args" not in describe(model):
            print(f"fedlight: note: config.yaml records the model {type(model).__name__} by class path only; pass "
                  "it to fit as a class-path spec ({'class_path': ..., 'init_args': {...}}) so landscape, sharpness "
                  "and --resume can rebuild it", file=sys.stderr)
    return model, text


def _fabric(accelerator: str, devices: int, num_nodes: int, precision: str):
    import lightning as L

    try:
        fabric = L.Fabric(accelerator=accelerator, devices=devices, num_nodes=num_nodes, precision=precision,
                          strategy="ddp" if devices * num_nodes > 1 else "auto")
    except (ValueError, RuntimeError, TypeError) as e:
        raise ConfigError(f"`accelerator`/`devices`/`precision` ({accelerator}, {devices}, {precision}): "
                          f"{str(e).splitlines()[0]}") from None
    fabric.launch()
    return fabric


def _check_args(algorithm, data, loop: LoopConfig, devices: int, num_nodes: int) -> None:
    from fedlight.advice import check_scales

    check_scales(algorithm, loop)  # an adaptive rule at an SGD-scale lr warns before round 1
    world = devices * num_nodes if isinstance(devices, int) and isinstance(num_nodes, int) else 1
    check(isinstance(devices, int) and devices > 0, f"`devices` must be a positive integer, got {devices!r}")
    check(isinstance(num_nodes, int) and num_nodes > 0, f"`num_nodes` must be a positive integer, got {num_nodes!r}")
    n = getattr(data, "num_clients", None)
    if n is not None:
        check(loop.clients_per_round <= n,
              f"`loop.clients_per_round` ({loop.clients_per_round}) exceeds `data.num_clients` ({n})")
    check(loop.clients_per_round >= world, f"`loop.clients_per_round` ({loop.clients_per_round}) must be at least "
          f"the number of processes (devices × num_nodes = {world})")


def _agree(fabric, step) -> None:
    """Run ``step`` (rank 0's part of a check) and make every rank raise the same error if it fails."""
    error = None
    try:
        step()
    except ConfigError as e:
        error = str(e)
    if fabric.world_size > 1:
        error = fabric.broadcast(error, src=0)
    if error is not None:
        raise ConfigError(error)


def _prepare(fabric, model, data, algorithm, task, loop, seed, out, ckpt, ckpt_path, defining, precision):
    """Data, task, the loop, the probe of one batch and the resume checks: everything that may refuse the run,
    before any file is written."""
    import torch

    from fedlight.loop import FederatedLoop
    from fedlight.tasks import resolve_task

    data.input_dtype = torch.float64 if precision == "64-true" else torch.float32  # float64 data keeps its precision
    with fabric.rank_zero_first():
        data.setup(fabric.device, seed)
    fault("setup", 0)
    check(loop.clients_per_round <= data.num_clients,
          f"`loop.clients_per_round` ({loop.clients_per_round}) exceeds `data.num_clients` ({data.num_clients})")
    task = resolve_task(task, model, data)  # set up by the loop, with the data
    loop, optimizer = _local_optimizer(fabric, model, task, algorithm, loop)
    runner = FederatedLoop(fabric, model, data, algorithm, loop, seed, out, task=task, optimizer=optimizer)
    runner.probe()  # one batch through model + task: a mismatch is refused before round 1
    _check_targets(task, loop)  # after the probe: a LightningModule's headline is known only then
    runner.store.use_folder(out / "client_state" / f"rank{fabric.global_rank}")  # unchanged states: never rewritten
    if ckpt is not None:
        _check_resume(runner, ckpt, ckpt_path, defining)
        runner.load(ckpt)
    return runner


def _check_targets(task, loop) -> None:
    from fedlight.run.files import is_fraction

    if is_fraction(task.headline_key):
        check(all(0 < t <= 1 for t in loop.targets), f"`loop.targets` are values of {task.headline_key}, a fraction: "
              f"they must be in (0, 1], got {loop.targets} (write 0.7 for 70 %)")


def _check_resume(runner, ckpt, ckpt_path, defining) -> None:
    from fedlight.run.files import meta_differences

    problems = meta_differences(ckpt["meta"], runner.meta())
    if not problems and ckpt.get("settings"):
        problems = differences(json.loads(ckpt["settings"]), defining)
    if problems:
        raise ConfigError(f"`resume` checkpoint {ckpt_path} does not match this run: {'; '.join(problems)}. "
                          "Resume with the settings it was trained with, or start a new run (another "
                          "`--out_dir`, or `--overwrite true` without `--resume`)")


def _local_optimizer(fabric, model, task, algorithm, loop):
    """A LightningModule's ``configure_optimizers`` as the local optimizer (its lr is the schedule's base, its weight
    decay the rules'), unless the rule prescribes its own; otherwise ``loop.optimizer``."""
    import dataclasses
    import functools

    from fedlight.rules import LocalUpdateRule

    optimizer = getattr(task, "optimizer", None)
    if optimizer is None or not task.has_optimizer(model):
        return loop, None
    name = type(model).__name__
    if type(algorithm.local).make_optimizer is not LocalUpdateRule.make_optimizer:
        fabric.print(f"fedlight: {type(algorithm).__name__} prescribes its own local optimizer; "
                     f"{name}.configure_optimizers() is not used")
        return loop, None
    cls, group, notes = optimizer(model)
    for note in notes:
        fabric.print(f"fedlight: note: {note}")
    args = ", ".join(f"{k}={v}" for k, v in group.items()
                     if k in ("lr", "weight_decay") or (isinstance(v, (int, float, tuple)) and v and v is not True))
    fabric.print(f"fedlight: local optimizer from {name}.configure_optimizers(): {cls.__name__}({args}); "
                 "`loop.lr`, `loop.optimizer` and `loop.weight_decay` are not used")
    loop = dataclasses.replace(loop, lr=float(group["lr"]), weight_decay=float(group.get("weight_decay", 0.0)),
                               momentum=0.0)
    hyper = {k: v for k, v in group.items() if k in _init_args(cls) and k != "lr"}
    return loop, functools.partial(cls, **hyper)


def _init_args(cls) -> set[str]:
    import inspect

    return set(inspect.signature(cls.__init__).parameters) - {"self", "params"}


def _segments(ckpt, start_round: int, execution: dict[str, Any]) -> list[dict[str, Any]]:
    """Execution-only settings per stretch of the run; a resume adds one, listing what changed."""
    before = json.loads(ckpt["segments"]) if ckpt is not None and ckpt.get("segments") else []
    execution = {k: v for k, v in execution.items() if k not in ("resume", "overwrite")}
    seg: dict[str, Any] = {"from_round": start_round, "settings": execution}
    if before:
        prev = before[-1]["settings"]
        seg["changed"] = sorted(k for k in prev.keys() | execution.keys()
                                if json.dumps(prev.get(k), default=str) != json.dumps(execution.get(k), default=str))
    return [*before, json.loads(json.dumps(seg, default=str))]


def _lr_hint(algorithm, loop: LoopConfig) -> str:
    from fedlight.rules import LocalUpdateRule

    name = type(algorithm).__name__
    own = type(algorithm.local).make_optimizer is not LocalUpdateRule.make_optimizer
    opt = f"{name}'s own local optimizer" if own else f"the local optimizer {loop.optimizer}"
    return (f"the learning rate `loop.lr` = {loop.lr:g} is too large for {opt} (adaptive optimizers such as Adam/AdamW "
            f"usually take ~1e-3); lower it, e.g. `--loop.lr {loop.lr / 100:g}`")


def _hparams(algorithm, loop, seed) -> dict[str, Any]:
    import dataclasses

    flat = {"algorithm": getattr(algorithm, "name", type(algorithm).__name__), "seed": seed}
    for k, v in dataclasses.asdict(loop).items():
        if isinstance(v, (int, float, str, bool)):
            flat[f"loop.{k}"] = v
    for k, v in {**vars(algorithm), **vars(algorithm).get("_init_args", {})}.items():
        if isinstance(v, (int, float, str, bool)):
            flat[f"algorithm.{k}"] = v
    return flat


def _default_algorithm() -> Algorithm:
    from fedlight.algorithms import FedAvg

    return FedAvg()


def _default_name(algorithm, model, data, seed: int) -> str:
    name = getattr(algorithm, "name", "custom")
    return f"{name}_{type(model).__name__.lower()}_{type(data).__name__.lower()}_s{seed}"


def _resolve_resume(resume: str | None, out: Path, defining: dict[str, Any] | None = None) -> Path | None:
    if resume is None:
        return None
    if resume == "auto":
        last = out / "checkpoints" / "last.ckpt"
        if last.exists() or last.with_name("prev.ckpt").exists():  # prev alone: killed between the two renames
            return last if last.exists() else last.with_name("prev.ckpt")
        _note(f"`--resume auto` found no checkpoint in {out}: nothing to resume, starting a new run there"
              f"{_other_run(out, defining or {})}")
        return None
    return Path(resume)


def _other_run(out: Path, defining: dict[str, Any]) -> str:
    """``; ... <dir> is a run of the same recipe whose settings differ: ...`` for the newest resumable sibling
    ``<name>-<hash>`` of a default run directory (the hash differs when defining settings do), or ``""``."""
    import re

    m = re.fullmatch(r"(.+)-[0-9a-f]{8}", out.name)
    if m is None or not out.parent.is_dir():
        return ""
    ckpts = sorted((d / "checkpoints" / "last.ckpt" for d in out.parent.glob(f"{m.group(1)}-*") if d != out),
                   key=lambda p: p.stat().st_mtime if p.exists() else 0, reverse=True)
    for ckpt in (c for c in ckpts if c.exists()):
        try:
            there = json.loads(load_checkpoint(ckpt).get("settings") or "{}")
        except ConfigError:
            continue
        diffs = differences(there, defining)
        if diffs:
            return (f"; {ckpt.parent.parent} is a run of the same recipe whose settings differ ({'; '.join(diffs)}): "
                    "to continue it, rerun with its settings or pass `--out_dir` " + str(ckpt.parent.parent))
    return ""


def _note(message: str) -> None:
    """One ``fedlight: note:`` line, from the launching process only (Fabric's launcher reruns ``fit`` per rank)."""
    import os

    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
        print(f"fedlight: note: {message}", file=sys.stderr, flush=True)


def _check_existing(out: Path, resume: str | None, overwrite: bool) -> bool | str:
    """A fresh run refuses a directory that holds another run unless told to overwrite it (cleared later, under the
    lock, by the run record). A directory whose run finished no round is not a run: it is reused (cleared too).
    Returns whether the directory is to be cleared (``"reuse"``: cleared, with a note once it is locked)."""
    if not out.exists() or not any(p.name != LOCK_NAME for p in out.iterdir()) or resume is not None:
        return overwrite
    if _no_round_finished(out):
        return "reuse"
    if not overwrite:
        raise ConfigError(f"`out_dir` {out} already holds a run; pass `--resume auto` to continue it, "
                          "`--overwrite true` to start over, or choose another `--out_dir`")
    if not any((out / f).exists() for f in RUN_FILES):
        raise ConfigError(f"`overwrite` refuses to clear {out}: it does not look like a fedlight run directory")
    return True


def _no_round_finished(out: Path) -> bool:
    """``out`` holds only fedlight run files, and no checkpoint, summary, final model or metrics row."""
    names = {p.name for p in out.iterdir()} - {LOCK_NAME}
    if not names <= set(RUN_FILES) or "config.yaml" not in names:
        return False
    if any((out / f).exists() for f in ("summary.json", "final_model.pt", "checkpoints/last.ckpt")):
        return False
    metrics = out / "metrics.jsonl"
    return not metrics.exists() or not metrics.read_text().strip()


def _describe(model, data, algorithm, task, loop, seed, precision=None, model_spec=None) -> str:
    """The resolved recipe of a Python-API run: class paths with the constructor arguments that can be recovered."""
    import dataclasses

    import yaml

    from fedlight.spec import describe

    return yaml.safe_dump({"seed": seed, "precision": precision, "model": model_spec or describe(model),
                           "data": describe(data), "algorithm": describe(algorithm),
                           **({"task": describe(task)} if task is not None else {}),
                           "loop": dataclasses.asdict(loop)}, sort_keys=False)


def _settings(text: str, precision: str) -> dict[str, Any]:
    import yaml

    try:
        settings = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        settings = {}
    settings = settings if isinstance(settings, dict) else {}
    return {**settings, "precision": precision}
