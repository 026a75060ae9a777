"""A LightningModule that carries its own data (``train_dataloader`` / ``val_dataloader`` / ``test_dataloader``,
``prepare_data`` and ``setup`` on the module, as ``Trainer.fit(model)`` without a datamodule reads them): its hooks as
a data module, split over clients by :class:`fedlight.data.DataModuleClients` like any other.

``setup(stage)`` is called once per stage with the stand-in trainer attached (Fabric's ``strategy``, ``world_size``,
``global_rank``, ``local_rank``), so a ``setup`` that reads ``self.trainer.strategy`` runs as under Lightning.
"""

from __future__ import annotations

from typing import Any

from fedlight.tasks.lightning.compat import is_lightning_module, overrides


def carries_data(obj: Any) -> bool:
    """Whether ``obj`` is a LightningModule with its own ``train_dataloader``."""
    return is_lightning_module(obj) and overrides(obj, "train_dataloader")


class ModuleData:
    """The data hooks of ``module`` as a ``LightningDataModule`` would offer them.

    Args:
        module: the LightningModule (the run's model).
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self.fabric: Any = None  # the run's Fabric (set before setup), for the trainer's strategy and ranks
        self.stages: set[str] = set()

    def prepare_data(self) -> None:
        if "prepare" not in self.stages:
            self.stages.add("prepare")
            self.module.prepare_data()

    def setup(self, stage: str) -> None:
        if stage in self.stages:
            return
        from fedlight.tasks.lightning.trainer import FedTrainer, attach

        self.stages.add(stage)
        if getattr(self.module, "_trainer", None) is None:  # the run's trainer replaces it once the data is split
            attach(self.module, FedTrainer(self.module, 1, 1, self.fabric))
        self.module.setup(stage)

    def train_dataloader(self) -> Any:
        return self.module.train_dataloader()

    def val_dataloader(self) -> Any:
        return self.module.val_dataloader()

    def test_dataloader(self) -> Any:
        return self.module.test_dataloader()

    def __repr__(self) -> str:
        return f"ModuleData({type(self.module).__name__})"


def own_data(data: Any) -> bool:
    """Whether ``data`` is a module's own data hooks, split over clients (its recipe records ``data: null``)."""
    return isinstance(getattr(data, "datamodule", None), ModuleData)
