"""``fit``: the Python entry point. Its typed signature is the recipe schema (the CLI is generated from it)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import nn

from fedlight.args import LoopConfig
from fedlight.data import FederatedDataModule
from fedlight.errors import ConfigError, check
from fedlight.rules import Algorithm

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed")
_RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "tb", "final_model.pt", "client_state")


def fit(
    model: nn.Module,
    data: FederatedDataModule,
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
    _config_text: str | None = None,
) -> dict[str, Any]:
    """Train ``model`` federatedly with ``algorithm`` on ``data`` and write the run record to ``out_dir``.

    Args:
        model: the network (a plain ``nn.Module``; e.g. ``fedlight.models.ResNet18``).
        data: a federated data module: dataset + partition (e.g. ``fedlight.data.CIFAR10``).
        algorithm: the federated rule pair (e.g. ``fedlight.algorithms.FedNSAM``); default FedAvg.
        loop: rounds, sampling, local steps, optimizer, schedule, evaluation and checkpoint settings.
        seed: every random stream (sampling, data order, augmentation, init) derives from it.
        out_dir: run directory; default ``runs/<algorithm>_<model>_<data>_s<seed>``.
        accelerator: ``cpu``, ``cuda``, ``gpu`` or ``auto``.
        devices: processes per node (client-parallel; ``ddp`` launcher, gloo on CPU, nccl on GPU).
        num_nodes: machines, through Fabric's launcher.
        precision: ``32-true`` (CPU default), ``bf16-mixed`` (GPU default), ``64-true``, ``bf16-true``, ``16-mixed``.
        resume: ``auto`` (continue from ``out_dir/checkpoints/last.ckpt`` when it exists) or a checkpoint path.
        overwrite: start over in an existing, non-empty run directory.

    Returns:
        The summary (also written to ``out_dir/summary.json``).
    """
    import lightning as L
    import torch

    from fedlight.advice import check_scales
    from fedlight.loop import FederatedLoop

    algorithm = algorithm if algorithm is not None else _default_algorithm()
    check_scales(algorithm, loop)  # an adaptive rule at an SGD-scale lr warns before round 1
    world = devices * num_nodes
    check(isinstance(devices, int) and devices > 0, f"`devices` must be a positive integer, got {devices!r}")
    check(isinstance(num_nodes, int) and num_nodes > 0, f"`num_nodes` must be a positive integer, got {num_nodes!r}")
    n = getattr(data, "num_clients", None)
    if n is not None:
        check(loop.clients_per_round <= n,
              f"`loop.clients_per_round` ({loop.clients_per_round}) exceeds `data.num_clients` ({n})")
    check(loop.clients_per_round >= world, f"`loop.clients_per_round` ({loop.clients_per_round}) must be at least "
          f"the number of processes (devices × num_nodes = {world})")
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if precision is None:
        precision = "32-true" if accelerator == "cpu" else "bf16-mixed"
    check(precision in PRECISIONS, f"`precision` must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "16-mixed" and algorithm.local.needs_true_grad_norm:
        raise ConfigError(f"`precision: 16-mixed` is refused by {type(algorithm).__name__}: it takes gradient norms, "
                          "which fp16 loss scaling distorts. Use `--precision bf16-mixed` or `32-true`")
    out = Path(out_dir) if out_dir else Path("runs") / _default_name(algorithm, model, data, seed)
    ckpt = _resolve_resume(resume, out)
    _prepare_out_dir(out, resume, overwrite)

    strategy = "ddp" if world > 1 else "auto"
    logger = None
    try:
        fabric = L.Fabric(accelerator=accelerator, devices=devices, num_nodes=num_nodes, precision=precision,
                          strategy=strategy)
    except (ValueError, RuntimeError, TypeError) as e:
        raise ConfigError(f"`accelerator`/`devices`/`precision` ({accelerator}, {devices}, {precision}): "
                          f"{str(e).splitlines()[0]}") from None
    fabric.launch()
    with fabric.rank_zero_first():
        data.setup(fabric.device, seed)
    check(loop.clients_per_round <= data.num_clients,
          f"`loop.clients_per_round` ({loop.clients_per_round}) exceeds `data.num_clients` ({data.num_clients})")
    if fabric.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        from fedlight.records import atomic_write_text

        atomic_write_text(out / "config.yaml", _config_text or _describe(model, data, algorithm, loop, seed))
        from fedlight.logger import RunLogger

        logger = RunLogger(out)
        logger.log_config(_config_text or "")
        logger.log_partition(data)
    runner = FederatedLoop(fabric, model, data, algorithm, loop, seed, out)
    if ckpt is not None:
        runner.load(ckpt)
    summary = runner.fit(logger=logger)
    if logger is not None:
        logger.log_summary(_hparams(algorithm, loop, seed), summary)
        logger.close()
    return summary


def _hparams(algorithm, loop, seed) -> dict[str, Any]:
    import dataclasses

    flat = {"algorithm": getattr(algorithm, "name", type(algorithm).__name__), "seed": seed}
    for k, v in dataclasses.asdict(loop).items():
        if isinstance(v, (int, float, str, bool)):
            flat[f"loop.{k}"] = v
    for k, v in vars(algorithm).items():
        if isinstance(v, (int, float, str, bool)):
            flat[f"algorithm.{k}"] = v
    return flat


def _default_algorithm() -> Algorithm:
    from fedlight.algorithms import FedAvg

    return FedAvg()


def _default_name(algorithm, model, data, seed: int) -> str:
    name = getattr(algorithm, "name", "custom")
    return f"{name}_{type(model).__name__.lower()}_{type(data).__name__.lower()}_s{seed}"


def _resolve_resume(resume: str | None, out: Path) -> Path | None:
    if resume is None:
        return None
    if resume == "auto":
        last = out / "checkpoints" / "last.ckpt"
        return last if last.exists() else None
    from fedlight.records import load_checkpoint

    load_checkpoint(Path(resume))  # fail early with a clear message
    return Path(resume)


def _prepare_out_dir(out: Path, resume: str | None, overwrite: bool) -> None:
    if not out.exists() or not any(out.iterdir()) or resume is not None:
        return
    if not overwrite:
        raise ConfigError(f"`out_dir` {out} already holds a run; pass `--resume auto` to continue it, "
                          "`--overwrite true` to start over, or choose another `--out_dir`")
    if not any((out / f).exists() for f in _RUN_FILES):
        raise ConfigError(f"`overwrite` refuses to clear {out}: it does not look like a fedlight run directory")
    for f in _RUN_FILES:
        p = out / f
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _describe(model, data, algorithm, loop, seed) -> str:
    import dataclasses

    import yaml

    def cls(o):
        return {"class_path": f"{type(o).__module__}.{type(o).__qualname__}"}

    return yaml.safe_dump({"seed": seed, "model": cls(model), "data": cls(data), "algorithm": cls(algorithm),
                           "loop": dataclasses.asdict(loop)}, sort_keys=False)
