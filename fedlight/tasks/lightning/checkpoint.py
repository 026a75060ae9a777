"""``RUN/final_model.ckpt``: the final global model as a checkpoint Lightning's ``LightningModule.load_from_checkpoint``
loads (the keys Lightning's own checkpoints carry: ``pytorch-lightning_version``, ``state_dict``,
``hyper_parameters`` from ``save_hyperparameters``, ``epoch``, ``global_step``; the module's ``on_save_checkpoint``
adds its own), written by the run on global rank 0 beside ``final_model.pt`` (``Task.final_files``), sealed as the
run's other files (``fedlight verify`` checks it)."""

from __future__ import annotations

from typing import Any

NAME = "final_model.ckpt"


def lightning_checkpoint(module: Any, epoch: int, global_step: int) -> dict[str, Any]:
    """The checkpoint dict of ``module`` as Lightning's ``Trainer.save_checkpoint`` writes a weights-only one."""
    import importlib

    from fedlight.tasks.lightning.compat import lightning_base

    package = lightning_base(module).__module__.split(".")[0]  # lightning or pytorch_lightning
    ckpt: dict[str, Any] = {
        "epoch": epoch, "global_step": global_step,
        "pytorch-lightning_version": importlib.import_module(package).__version__,
        "state_dict": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
        "loops": None, "callbacks": {}, "optimizer_states": [], "lr_schedulers": []}
    if module.hparams:
        if hasattr(module, "_hparams_name"):
            ckpt["hparams_name"] = module._hparams_name
        ckpt["hyper_parameters"] = dict(module.hparams)
    module.on_save_checkpoint(ckpt)
    return ckpt

