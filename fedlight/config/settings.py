"""What a run records about its settings: the resolved recipe (``config.yaml``), the defining settings,
TensorBoard's hyperparameters and the default run name (the execution-only settings per stretch of the run are the
loop state's segments: :meth:`~fedlight.engine.loop_state.LoopState.begin_segment`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from fedlight.core.loop_config import AUTO_CLIP, LoopConfig
from fedlight.core.spec import describe


def recipe_text(model, data, algorithm, task, loop, seed, precision=None, model_spec=None, privacy=None) -> str:
    """The resolved recipe of a Python-API run: class paths with the constructor arguments that can be recovered
    (``data: null`` for a LightningModule's own data hooks)."""
    from fedlight.tasks.lightning.module_data import own_data

    return yaml.safe_dump({"seed": seed, "precision": precision, "model": model_spec or describe(model),
                           "data": None if own_data(data) else describe(data), "algorithm": describe(algorithm),
                           **({"task": describe(task)} if task is not None else {}),
                           "loop": dataclasses.asdict(loop),
                           **({"privacy": dataclasses.asdict(privacy)} if privacy is not None else {})},
                          sort_keys=False)


def settings(text: str, precision: str) -> dict[str, Any]:
    """The run's settings: the recipe text parsed, with the resolved precision."""
    try:
        parsed = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        parsed = {}
    return {**(parsed if isinstance(parsed, dict) else {}), "precision": precision}


CLIP_KEY = "loop.max_grad_norm"


def resolve_clip(defining: dict[str, Any], lightning: bool) -> dict[str, Any]:
    """The defining settings with ``loop.max_grad_norm: auto`` as the clip it stands for with this model (10 for
    fedlight's own models, none for a LightningModule): what trains is what the run is, so a run recorded before
    ``auto`` was the default (``10.0``) keeps its run directory name and resumes under the default."""
    if defining.get(CLIP_KEY) != "auto":
        return defining
    return {**defining, CLIP_KEY: None if lightning else AUTO_CLIP}


ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam")
"""torch.optim's adaptive optimizers: their learning rates are of another scale (~1e-3) than SGD's."""


def lr_hint(algorithm, loop: LoopConfig, privacy=None) -> str:
    """The likely causes of a diverging run, for the exploding-loss warning: the learning rate for the optimizer
    that really trains (a rule's own optimizer is Adam-type), and first, for a private run, its noise."""
    name = type(algorithm).__name__
    own = algorithm.local.brings_optimizer  # FedAdamW, Local Adam/AdamW, FedLADA: Adam-type optimizers
    adaptive = own or loop.optimizer.rsplit(".", 1)[-1] in ADAPTIVE
    opt = f"{name}'s own local optimizer" if own else f"the local optimizer {loop.optimizer}"
    scale = " (adaptive optimizers such as Adam/AdamW usually take ~1e-3)" if adaptive else ""
    lr = (f"the learning rate `loop.lr` = {loop.lr:g} is too large for {opt}{scale}; lower it, e.g. "
          f"`--loop.lr {loop.lr / (100 if adaptive else 10):g}`")
    if privacy is None:
        return lr
    if getattr(privacy, "level", "client") == "record":
        noise = ("the DP-SGD noise (σ·C on each local step's sum of clipped example gradients, C = `privacy.clip`) "
                 "outweighs the gradients: larger batches or a larger `privacy.target_epsilon`")
    else:
        noise = ("the privacy noise outweighs the clipped updates (σ·C/m per coordinate of the mean update, σ as "
                 "printed before round 1, C = `privacy.clip`, m = `loop.clients_per_round`): more clients (in the "
                 "population and per round; see docs/privacy.md), a smaller `privacy.clip` or a larger "
                 "`privacy.target_epsilon`")
    return f"{noise}; or {lr}"


def hparams(algorithm, loop, seed) -> dict[str, Any]:
    flat = {"algorithm": getattr(algorithm, "name", type(algorithm).__name__), "seed": seed}
    for k, v in dataclasses.asdict(loop).items():
        if isinstance(v, (int, float, str, bool)):
            flat[f"loop.{k}"] = v
    for k, v in {**vars(algorithm), **vars(algorithm).get("_init_args", {})}.items():
        if isinstance(v, (int, float, str, bool)):
            flat[f"algorithm.{k}"] = v
    return flat


def default_name(algorithm, model, data, seed: int) -> str:
    name = getattr(algorithm, "name", "custom")
    return f"{name}_{type(model).__name__.lower()}_{type(data).__name__.lower()}_s{seed}"
