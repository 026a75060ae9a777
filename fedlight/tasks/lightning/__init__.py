"""A LightningModule (and its LightningDataModule) trained by fedlight's rules: the task, its hooks, logs and
local optimisation. ``LightningTask`` is the face; the other modules are its parts."""

from fedlight.tasks.lightning.compat import is_lightning_module
from fedlight.tasks.lightning.module_data import ModuleData
from fedlight.tasks.lightning.task import LightningTask

__all__ = ["LightningTask", "ModuleData", "is_lightning_module"]
