"""A tiny GAN written the way Lightning's GAN example is (two optimizers, manual optimisation, toggle_optimizer,
``training_step(self, batch)`` without ``batch_idx``, ``opt_g, opt_d = self.optimizers()``, no test_step), on tiny
random images instead of MNIST."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class TinyGAN(pl.LightningModule):
    def __init__(self, latent: int = 3, pixels: int = 16, lr: float = 2e-3):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(latent, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, pixels))
        self.discriminator = nn.Sequential(nn.Linear(pixels, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))

    def forward(self, z):
        return torch.tanh(self.generator(z)).view(len(z), 1, 4, 4)

    def training_step(self, batch):
        images, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(len(images), self.hparams.latent).type_as(images)
        real, fake = torch.ones(len(images), 1).type_as(images), torch.zeros(len(images), 1).type_as(images)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).flatten(1)), real)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        d_loss = (F.binary_cross_entropy_with_logits(self.discriminator(images.flatten(1)), real)
                  + F.binary_cross_entropy_with_logits(self.discriminator(self(z).detach().flatten(1)), fake)) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        lr = self.hparams.lr
        return (torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999)))


class TinyImages(pl.LightningDataModule):
    def setup(self, stage: str):
        g = torch.Generator().manual_seed(0)
        self.train = TensorDataset(torch.rand(48, 1, 4, 4, generator=g) * 2 - 1, torch.zeros(48, dtype=torch.int64))
        self.test = TensorDataset(torch.rand(16, 1, 4, 4, generator=g) * 2 - 1, torch.zeros(16, dtype=torch.int64))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=4, shuffle=True)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=8)
