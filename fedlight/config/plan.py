"""What ``fit`` resolves before the engine is built: a :class:`Plan` (model, data, rule, task, settings, run
directory), and the checks of ``fit``'s arguments that need no data set up yet (:func:`check_clients` runs again
once the data knows its clients).
"""

from __future__ import annotations

import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedlight.algorithms import FedAvg
from fedlight.config import settings as recorded
from fedlight.config.advice import check_scales, python_defaults
from fedlight.core.loop_config import LoopConfig
from fedlight.core.rules import Algorithm
from fedlight.core.spec import build, describe
from fedlight.data import FederatedDataModule, as_federated
from fedlight.errors import ConfigError, check
from fedlight.privacy import settings as privacy_settings
from fedlight.privacy.settings import PrivacyConfig
from fedlight.run.directory import settings_hash, split_settings
from fedlight.tasks import Task
from fedlight.tasks.lightning import is_lightning_module

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed")


@dataclass
class Plan:
    """What ``fit`` resolved before the engine is built: the parts, the settings, where the run lives and the
    checkpoint it continues from."""

    model: nn.Module
    data: FederatedDataModule
    algorithm: Algorithm
    task: Task | None
    """As given (``None``: resolved with the data, see :func:`~fedlight.tasks.resolve_task`)."""
    loop: LoopConfig
    seed: int
    accelerator: str
    precision: str
    text: str
    """The resolved recipe (``config.yaml``)."""
    defining: dict[str, Any]
    """Settings that define the run (hashed into the default directory name; a resume must agree on them)."""
    execution: dict[str, Any]
    """Settings that may change between segments of a run."""
    out: Path
    ckpt_path: Path | None = None
    ckpt: dict[str, Any] | None = None
    clear: bool = False
    """Clear ``out`` before the first write (``--overwrite``, or a failed start's directory)."""
    trackers: tuple[bool, list[dict[str, Any]]] = (True, [])
    """``loggers`` parsed: TensorBoard on, the other trackers (:func:`fedlight.run.tracker_entries.parse`)."""
    privacy: PrivacyConfig | None = None
    before: tuple | None = None
    """``out`` as the start decision read it (:func:`fedlight.run.directory.snapshot`)."""


def resolve_plan(model, data, algorithm, loop, seed, out_dir, accelerator, precision, task, text, world,
          privacy=None) -> Plan:
    """Check the arguments, build a model given as a spec, describe the recipe and name the run directory."""
    from fedlight.tasks.lightning.compat import uncompiled

    algorithm = algorithm if algorithm is not None else default_algorithm()
    loop = python_defaults(algorithm, loop) if text is None else loop  # the CLI chose them already
    model = uncompiled(model)
    data = as_federated(data_or_own(data, model))
    check_seed(seed)
    _check_args(algorithm, data, loop, *world)
    accelerator, precision = resolve_device(accelerator, precision, algorithm)
    if privacy is not None:
        # bad values: one line, before anything is built
        privacy_settings.validate(privacy, sampling=loop.sampling, on_nonfinite=loop.on_nonfinite)
    model, text = _model_and_config(model, data, algorithm, task, loop, seed, precision, text, privacy)
    defining, execution = split_settings(recorded.settings(text, precision))
    if defining.get("privacy", 0) is None:  # a run without privacy keeps the directory name it had before the key
        del defining["privacy"]
    for key in ("loop.sampling", "privacy.relation"):  # at their defaults: the names runs had before the keys
        if defining.get(key, 0) in ("fixed", None):
            defining.pop(key, None)
    defining = recorded.resolve_clip(defining, is_lightning_module(model))
    name = f"{recorded.default_name(algorithm, model, data, seed)}-{settings_hash(defining)}"
    return Plan(model=model, data=data, algorithm=algorithm, task=task, loop=loop, seed=seed, accelerator=accelerator,
                precision=precision, text=text, defining=defining, execution=execution,
                out=Path(out_dir) if out_dir else Path("runs") / name, privacy=privacy)


def data_or_own(data, model) -> Any:
    """``data``; not given: a LightningModule's own data hooks (the module), else one line naming the setting."""
    from fedlight.tasks.lightning.module_data import carries_data

    if data is not None:
        return data
    if isinstance(model, (dict, str)) or not carries_data(model):
        raise ConfigError("`data` is missing: give a data module (e.g. `--data fedlight.data.CIFAR10`, or a "
                          "LightningDataModule), or a LightningModule that defines its own train_dataloader")
    return model


def resolve_device(accelerator: str, precision: str | None, algorithm) -> tuple[str, str]:
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if precision is None:
        precision = "32-true" if accelerator == "cpu" else "bf16-mixed"
    check(precision in PRECISIONS, f"`precision` must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "16-mixed" and algorithm.local.needs_true_grad_norm:
        raise ConfigError(f"`precision: 16-mixed` is refused by {type(algorithm).__name__}: it takes gradient norms, "
                          "which fp16 loss scaling distorts. Use `--precision bf16-mixed` or `32-true`")
    return accelerator, precision


def _model_and_config(model, data, algorithm, task, loop, seed, precision, text, privacy=None):
    """The model (built here, after seeding, when given as a class-path spec, as the CLI builds it) and the
    resolved config text (described from the objects for a Python-API run)."""
    spec = None
    if isinstance(model, (dict, str)):
        spec = {"class_path": model} if isinstance(model, str) else model
        torch.manual_seed(seed)
        model = build(spec)
    if text is None:
        text = recorded.recipe_text(model, data, algorithm, task, loop, seed, precision=precision, model_spec=spec,
                                    privacy=privacy)
        if spec is None and "init_args" not in describe(model):
            print(f"fedlight: note: config.yaml records the model {type(model).__name__} by class path only; pass "
                  "it to fit as a class-path spec ({'class_path': ..., 'init_args': {...}}) so landscape, sharpness "
                  "and --resume can rebuild it", file=sys.stderr)
    return model, text


SEED_MAX = 2**32 - 1
"""The largest seed: every random stream derives from it (NumPy's and PyTorch's generators take 0..2**32 - 1 alike)."""


def check_seed(seed: Any, name: str = "seed") -> None:
    """A seed is a whole number from 0 to :data:`SEED_MAX`; anything else is one line naming ``name``."""
    ok = isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and 0 <= seed <= SEED_MAX
    check(ok, f"`{name}` must be a whole number from 0 to {SEED_MAX}, got {seed!r}")


def _check_args(algorithm, data, loop: LoopConfig, devices: int, num_nodes: int) -> None:
    check_scales(algorithm, loop)  # an adaptive rule at an SGD-scale lr warns before round 1
    world = devices * num_nodes if isinstance(devices, int) and isinstance(num_nodes, int) else 1
    check(isinstance(devices, int) and devices > 0, f"`devices` must be a positive integer, got {devices!r}")
    check(isinstance(num_nodes, int) and num_nodes > 0, f"`num_nodes` must be a positive integer, got {num_nodes!r}")
    check_clients(loop, getattr(data, "num_clients", None))  # again after data.setup when unknown here
    check(loop.clients_per_round >= world, f"`loop.clients_per_round` ({loop.clients_per_round}) must be at least "
          f"the number of processes (devices × num_nodes = {world})")


def check_clients(loop: LoopConfig, num_clients: int | None) -> None:
    if num_clients is not None:
        check(loop.clients_per_round <= num_clients,
              f"`loop.clients_per_round` ({loop.clients_per_round}) exceeds `data.num_clients` ({num_clients})")


def default_algorithm() -> Algorithm:
    return FedAvg()
