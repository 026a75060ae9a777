"""Everything a LightningModule can override or configure that fedlight does not call as Lightning's Trainer does:
refused before round 1 in one line (what fedlight lacks, what to do), or said once in a note (what fedlight does
instead, when the result is still the author's intent). What fedlight calls as the Trainer does is listed in
docs/lightning.md's table; nothing is skipped in silence.
"""

from __future__ import annotations

from typing import Any

from fedlight.errors import ConfigError
from fedlight.tasks.lightning.compat import module_name, note, overrides

REFUSED = {
    "backward": "fedlight's rules take each gradient themselves (SAM-type rules take two per step), so an "
                "overridden backward is not called; move what it adds into on_before_backward / on_after_backward",
    "optimizer_zero_grad": "fedlight zeroes a client's gradients before each local step (Lightning's default), so an "
                           "overridden optimizer_zero_grad is not called; remove it (accumulate gradients with manual "
                           "optimisation, which fedlight runs as Lightning does)",
    "lr_scheduler_step": "fedlight replays schedulers by their own step() (docs/lightning.md), so lr_scheduler_step "
                         "is not called; return a torch scheduler (e.g. LambdaLR over your schedule's function)",
    "transfer_batch_to_device": "fedlight moves the batches to the device itself, so the batch-transfer hooks are "
                                "not called; transform the batch in your dataset or collate_fn, or at the start of "
                                "training_step / test_step",
    "on_test_model_eval": "fedlight evaluates the global model in eval mode and restores the mode itself, so the "
                          "model-mode hooks are not called; set the modes you need in on_test_epoch_start / "
                          "on_test_epoch_end (on_validation_* with a validation_step)",
}
SAME_AS = {"on_before_batch_transfer": "transfer_batch_to_device", "on_after_batch_transfer":
           "transfer_batch_to_device", "on_test_model_train": "on_test_model_eval", "on_validation_model_eval":
           "on_test_model_eval", "on_validation_model_train": "on_test_model_eval",
           "on_validation_model_zero_grad": "on_test_model_eval"}
NOTED = {
    "predict_step": "fedlight does not predict: predict_step (and the predict hooks) are not called in the run; "
                    "load RUN/final_model.ckpt with load_from_checkpoint and use Trainer.predict",
}


def check(model: Any, fabric: Any, by_test_step: bool, datamodule: Any = None) -> None:
    """Refuse the first overridden method fedlight cannot run as Lightning does (of the module, or of its
    LightningDataModule's batch-transfer hooks); note the others once each."""
    name = module_name(model)
    for method, why in [*REFUSED.items(), *((m, REFUSED[s]) for m, s in SAME_AS.items())]:
        if overrides(model, method):
            raise ConfigError(f"{name}.{method}: {why}")
    for method in ("transfer_batch_to_device", "on_before_batch_transfer", "on_after_batch_transfer"):
        if datamodule is not None and overrides(datamodule, method):
            raise ConfigError(f"{type(datamodule).__name__}.{method}: {REFUSED['transfer_batch_to_device']}")
    for method, what in NOTED.items():
        if overrides(model, method):
            note(fabric, f"{name}: {what}")
    validation = [m for m in ("validation_step", "on_validation_start", "on_validation_epoch_start",
                              "on_validation_epoch_end", "on_validation_end") if overrides(model, m)]
    if by_test_step and validation:
        note(fabric, f"{name} has a test_step: each round's evaluation is test_step with the test hooks; "
                     f"{', '.join(validation)} {'is' if len(validation) == 1 else 'are'} not called (one evaluation "
                     "per round; drop test_step to evaluate by validation_step)")
    _callbacks(model, fabric, name)


CALLBACKS = {
    "LearningRateMonitor": "the lr of each round's first local step is the `lr` column of metrics.jsonl (TensorBoard "
                           "train/lr), with `lr_last` when the round's last step used another: the monitor per round",
    "ModelCheckpoint": "fedlight writes RUN/checkpoints/last.ckpt every `loop.save_every` rounds (for --resume) and "
                       "RUN/final_model.ckpt at the end, which load_from_checkpoint loads; summary.json's "
                       "best_<headline> and best_round name the best round (no best-k files)",
    "EarlyStopping": "not applied: a client's epoch is a few local steps of one round and stopping one client does "
                     "not stop the federation; the run trains `loop.rounds` rounds (summary.json records the round "
                     "each of `loop.targets` is reached)",
}


def _callbacks(model: Any, fabric: Any, name: str) -> None:
    """``configure_callbacks()``: each callback honoured at round level or said why not; any other refused."""
    if not overrides(model, "configure_callbacks"):
        return
    found = model.configure_callbacks() or []
    for cb in found if isinstance(found, (list, tuple)) else [found]:
        kinds = [c.__name__ for c in type(cb).__mro__]
        kind = next((k for k in kinds if k in CALLBACKS), None)
        if kind is None:
            raise ConfigError(f"{name}.configure_callbacks() returns {type(cb).__name__}, whose hooks fedlight does "
                              "not call (no Trainer runs); move its logic into the module's hooks, or remove it")
        note(fabric, f"{name}.configure_callbacks() {type(cb).__name__}: {CALLBACKS[kind]}")
