"""Lightning's own Trainer on one client's batches: the reference a federated run with one client and one round
must equal (64-true)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from fedlight.core.sampling import client_generator


def client_batches(data, steps: int, client: int = 0, round: int = 0) -> list:
    """The batches fedlight gives ``client`` in ``round`` (seed 0), in float64."""
    data.input_dtype = torch.float64
    data.setup("cpu", 0)
    return list(data.client_batches(client, steps, client_generator(0, round, client)))


class Epochs:
    """A train loader whose epoch ``e`` (the module's ``current_epoch``) yields ``epochs[e]`` (a client's batches of
    round ``e``)."""

    def __init__(self, epochs: list, module) -> None:
        self.epochs, self.module = epochs, module

    def __len__(self) -> int:
        return len(self.epochs[0])

    def __iter__(self):
        return iter(self.epochs[min(self.module.current_epoch, len(self.epochs) - 1)])


def trainer_fit(module, batches: list, test_batches: list | None = None, later: tuple = (), **kwargs) -> dict:
    """Lightning's Trainer over ``batches`` (one epoch, then one per list of ``later``; then ``test`` over
    ``test_batches``); its metrics. ``kwargs``: more Trainer arguments."""
    trainer = pl.Trainer(max_epochs=1 + len(later), accelerator="cpu", precision="64-true", logger=False,
                         enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no workers for a list of batches, and the like
        trainer.fit(module, Epochs([batches, *later], module) if later else DataLoader(batches, batch_size=None))
        out = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if test_batches is not None:
            out.update({k: float(v) for k, v in trainer.test(module, DataLoader(test_batches, batch_size=None),
                                                             verbose=False)[0].items()})
    return out
