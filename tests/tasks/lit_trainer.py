"""Lightning code that leans on the Trainer's machinery, as published examples write it (issue 51): images through
``self.logger.experiment`` (the tutorials' basic GAN), data hooks on the module with a ``setup`` reading
``self.trainer.strategy`` (Lightning's ImageNet template), ``self.trainer.is_last_batch`` (the manual-optimisation
idiom), ``drop_last`` with BatchNorm (the UvA-DL CIFAR module), a module naming its own string classes, and a
OneCycleLR sized for the author's epochs."""

from __future__ import annotations

import torch
from lit import LitMLP, blobs
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset


class Drawing(LitMLP):
    """Logs a picture of its first layer at the epoch, as the basic GAN logs its samples."""

    def training_step(self, batch, batch_idx):
        w = self.net[0].weight.detach()
        self.logger.experiment.add_image("weights", (w - w.min()) / (w.max() - w.min() + 1e-12), self.current_epoch,
                                         dataformats="HW")
        return super().training_step(batch, batch_idx)


class OwnData(LitMLP):
    """Its own data (no datamodule), BatchNorm, ``drop_last``; ``setup`` reads the trainer's strategy and ranks."""

    def __init__(self, n_train: int = 70, batch_size: int = 6, drop_last: bool = True):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
        self.n_train, self.batch_size, self.drop_last = n_train, batch_size, drop_last
        self.seen_setup: list = []

    def setup(self, stage):
        t = self.trainer
        self.seen_setup.append((stage, type(t.strategy).__name__, t.world_size, t.global_rank, t.local_rank))
        x, y = blobs(self.n_train, seed=1)
        self.train_set = TensorDataset(x, y)
        self.train_set.targets = y
        self.test_set = TensorDataset(*blobs(30, seed=2))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=self.drop_last)

    def val_dataloader(self):
        return DataLoader(self.test_set, batch_size=10)


class LastBatch(LitMLP):
    """Manual optimisation that accumulates every batch and steps once, at ``self.trainer.is_last_batch``."""

    def __init__(self):
        super().__init__(momentum=0.0)
        self.automatic_optimization = False
        self.last: list[bool] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.manual_backward(loss)
        self.last.append(bool(self.trainer.is_last_batch))
        if self.trainer.is_last_batch:
            opt = self.optimizers()
            opt.step()
            opt.zero_grad()


class Names(Dataset):
    """Samples labelled by class name (``targets`` too), as a folder of named images is."""

    classes = ("cat", "dog", "emu")

    def __init__(self, n: int = 60, seed: int = 1):
        self.x, y = blobs(n, seed=seed)
        self.targets = [self.classes[int(v)] for v in y]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.targets[i]


class Named(LitMLP):
    """Turns its own class names into indices (it fails on anything but the names its loader yields)."""

    def _indices(self, names):
        return torch.tensor([Names.classes.index(n) for n in names])

    def training_step(self, batch, batch_idx):
        x, names = batch
        assert all(isinstance(n, str) for n in names)
        return super().training_step((x, self._indices(names)), batch_idx)

    def test_step(self, batch, batch_idx):
        x, names = batch
        return super().test_step((x, self._indices(names)), batch_idx)


class OneCycle(LitMLP):
    """A OneCycleLR sized for the author's epochs: ``steps_per_epoch`` fixed for a full data set."""

    steps_per_epoch = 50

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, epochs=self.trainer.max_epochs,
                                                    steps_per_epoch=self.steps_per_epoch)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
