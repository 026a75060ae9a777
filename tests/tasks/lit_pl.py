"""Lightning code as Flower's and NVFlare's examples write it: ``import pytorch_lightning``, an autoencoder whose
training_step ignores the labels, a classifier logging a torchmetrics ``Accuracy``, and a data module."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torchmetrics
from lit import blobs
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class LitAutoEncoder(pl.LightningModule):
    def __init__(self, lr: float = 1e-2):
        super().__init__()
        self.lr = lr
        self.encoder = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        self.decoder = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 8))

    def training_step(self, batch, batch_idx):
        x, _ = batch  # labels are not used
        loss = F.mse_loss(self.decoder(self.encoder(x)), x)
        self.log("train_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        x, _ = batch
        self.log("test_loss", F.mse_loss(self.decoder(self.encoder(x)), x))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class LitNet(pl.LightningModule):
    def __init__(self, lr: float = 0.05, momentum: float = 0.9):
        super().__init__()
        self.lr, self.momentum = lr, momentum
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.accuracy(logits, y)
        self.log("test_accuracy", self.accuracy)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class PLBlobs(pl.LightningDataModule):
    def __init__(self, batch_size: int = 6):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str):
        x, y = blobs(120, seed=1)
        self.train = TensorDataset(x, y)
        self.train.targets = y
        self.test = TensorDataset(*blobs(60, seed=2))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=20)
