"""A user's own Lightning code, as a researcher would bring it: a LightningModule and a LightningDataModule."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class LitMLP(pl.LightningModule):
    """Counts every call fedlight makes, logs a value and a torchmetrics object, brings its own optimizer."""

    def __init__(self, in_features: int = 8, classes: int = 3, lr: float = 0.2, momentum: float = 0.5,
                 per_sample_loss: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, 16), nn.Tanh(), nn.Linear(16, classes))
        self.lr, self.momentum, self.per_sample_loss = lr, momentum, per_sample_loss
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=classes, average="micro")
        self.calls = {"training_step": 0, "test_step": 0, "configure_optimizers": 0}
        self.batch_indices: list[int] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.calls["training_step"] += 1
        self.batch_indices.append(batch_idx)
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, reduction="none" if self.per_sample_loss else "mean")
        self.log("train_acc", (logits.argmax(-1) == y).float().mean())
        return {"loss": loss}

    def test_step(self, batch, batch_idx):
        self.calls["test_step"] += 1
        x, y = batch
        logits = self(x)
        self.acc.update(logits, y)
        self.log("test_loss", F.cross_entropy(logits, y), batch_size=len(y))
        self.log("test_acc", self.acc)

    def configure_optimizers(self):
        self.calls["configure_optimizers"] += 1
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Scheduled(LitMLP):
    """A warm-down by step (over estimated_stepping_batches) or a StepLR by epoch; records the trainer state and
    the lr of every training_step; logs at each epoch end."""

    def __init__(self, interval: str = "step"):
        super().__init__()
        self.interval, self.seen = interval, []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, self.global_step, self.optimizers().param_groups[0]["lr"]))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        total = self.trainer.estimated_stepping_batches
        if self.interval == "step":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / total)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    def on_train_epoch_end(self):
        self.log("epoch_end_step", float(self.trainer.global_step))
        self.log("w_norm", self.net[0].weight.norm())

    def on_test_epoch_end(self):
        self.log("test_epoch", float(self.current_epoch))


def blobs(n: int, in_features: int = 8, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, in_features, generator=g) + F.one_hot(y, in_features).float() * 2
    return x, y


class BlobsDataModule(pl.LightningDataModule):
    """Own datasets, own collate (counts its calls and returns a tuple), own batch size."""

    def __init__(self, n_train: int = 120, n_test: int = 60, batch_size: int = 6):
        super().__init__()
        self.n_train, self.n_test, self.batch_size = n_train, n_test, batch_size
        self.stages: list[str] = []
        self.collated = 0

    def prepare_data(self):
        self.stages.append("prepare")

    def setup(self, stage: str):
        self.stages.append(stage)
        x, y = blobs(self.n_train, seed=1)
        self.train = TensorDataset(x, y)
        self.train.targets = y
        self.test = TensorDataset(*blobs(self.n_test, seed=2))

    def collate(self, samples):
        self.collated += 1
        xs, ys = zip(*samples)
        return torch.stack(xs), torch.stack(ys)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=20, collate_fn=self.collate)
