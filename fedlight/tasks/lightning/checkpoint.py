"""``RUN/final_model.ckpt``: the final global model as a checkpoint Lightning's ``LightningModule.load_from_checkpoint``
loads (the keys Lightning's own checkpoints carry: ``pytorch-lightning_version``, ``state_dict``,
``hyper_parameters`` from ``save_hyperparameters``, ``epoch``, ``global_step``; the DataModule's ``state_dict`` under
its class name and what the module's ``on_save_checkpoint`` adds, as Lightning writes them), written by the run on
global rank 0 beside ``final_model.pt`` (``Task.final_files``), sealed as the run's other files (``fedlight verify``
checks it).

Every fedlight checkpoint (``--resume``) keeps the same extras (:func:`extras`: ``on_save_checkpoint`` called at each
save, as a Trainer's ``ModelCheckpoint`` calls it); a resumed run gives them back (:func:`restore`: the DataModule's
``load_state_dict``, then ``on_load_checkpoint``), as ``Trainer.fit(ckpt_path=...)`` does."""

from __future__ import annotations

import copy
from typing import Any

NAME = "final_model.ckpt"
BASE = ("epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops", "callbacks", "optimizer_states",
        "lr_schedulers", "hparams_name", "hyper_parameters")


def lightning_checkpoint(module: Any, epoch: int, global_step: int, datamodule: Any = None,
                         state: bool = True) -> dict[str, Any]:
    """The checkpoint dict of ``module`` as Lightning's ``Trainer.save_checkpoint`` writes a weights-only one
    (``state=False``: the state dict's tensors not copied)."""
    import importlib

    from fedlight.tasks.lightning.compat import lightning_base

    package = lightning_base(module).__module__.split(".")[0]  # lightning or pytorch_lightning
    ckpt: dict[str, Any] = {
        "epoch": epoch, "global_step": global_step,
        "pytorch-lightning_version": importlib.import_module(package).__version__,
        "state_dict": {k: v.detach().cpu().clone() if state else v for k, v in module.state_dict().items()},
        "loops": None, "callbacks": {}, "optimizer_states": [], "lr_schedulers": []}
    if module.hparams:
        if hasattr(module, "_hparams_name"):
            ckpt["hparams_name"] = module._hparams_name
        ckpt["hyper_parameters"] = dict(module.hparams)
    if datamodule is not None and hasattr(datamodule, "state_dict"):
        held = datamodule.state_dict()
        if held:
            ckpt[type(datamodule).__qualname__] = held
    module.on_save_checkpoint(ckpt)
    return ckpt


def extras(module: Any, epoch: int, global_step: int, datamodule: Any = None) -> dict[str, Any]:
    """The keys of the module's checkpoint beyond Lightning's own (the DataModule's state, ``on_save_checkpoint``'s),
    as a private copy (written while the next round runs)."""
    ckpt = lightning_checkpoint(module, epoch, global_step, datamodule, state=False)
    return copy.deepcopy({k: v for k, v in ckpt.items() if k not in BASE})


def restore(module: Any, kept: dict[str, Any], datamodule: Any = None) -> None:
    """``kept`` (:func:`extras`) given back: the DataModule's ``load_state_dict`` with its state, then the module's
    ``on_load_checkpoint`` with the checkpoint, as Lightning's Trainer restores them."""
    kept = copy.deepcopy(kept)
    name = type(datamodule).__qualname__ if datamodule is not None else None
    if name in kept and hasattr(datamodule, "load_state_dict"):
        datamodule.load_state_dict(kept[name])
    module.on_load_checkpoint({"state_dict": module.state_dict(), **kept})
