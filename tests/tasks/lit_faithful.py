"""Stand-ins for published Lightning code in its own idiom (issue 59): UvA-DL tutorial 5's warm-up stepped in
``optimizer_step``, tutorial 12's ProtoNet batches from a ``batch_sampler``, the tutorials' GAN logging images in
``on_validation_epoch_end``, ``configure_callbacks``, several test loaders and hooks that create state."""

from __future__ import annotations

import math
import random

import torch
from lit import LitMLP, blobs
from torch import optim
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class CosineWarmupScheduler(optim.lr_scheduler._LRScheduler):
    """UvA-DL tutorial 5's scheduler: linear warm-up, then cosine, per iteration."""

    def __init__(self, optimizer, warmup, max_iters):
        self.warmup, self.max_num_iters = warmup, max_iters
        super().__init__(optimizer)

    def get_lr(self):
        return [base_lr * self.get_lr_factor(epoch=self.last_epoch) for base_lr in self.base_lrs]

    def get_lr_factor(self, epoch):
        lr_factor = 0.5 * (1 + math.cos(math.pi * epoch / self.max_num_iters))
        if epoch <= self.warmup:
            lr_factor *= epoch * 1.0 / self.warmup
        return lr_factor


class WarmupTransformer(LitMLP):
    """Tutorial 5's idiom: the scheduler is kept on the module and stepped per iteration in ``optimizer_step``
    (it is not returned by ``configure_optimizers``, so the optimizer's lr starts at 0)."""

    def __init__(self, lr: float = 3e-2, warmup: int = 3, max_iters: int = 50):
        super().__init__(lr=lr)
        self.warmup, self.max_iters, self.lrs = warmup, max_iters, []

    def configure_optimizers(self):
        optimizer = optim.Adam(self.parameters(), lr=self.lr)
        self.lr_scheduler = CosineWarmupScheduler(optimizer, warmup=self.warmup, max_iters=self.max_iters)
        return optimizer

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.lr_scheduler.step()  # Step per iteration
        self.lrs.append(self.lr_scheduler.get_last_lr()[0])


class Compiled(LitMLP):
    """The Lightning docs' ``torch.compile(model)`` on a module with SGD momentum 0.9 that logs."""

    def __init__(self):
        super().__init__(momentum=0.9)


class StartState(LitMLP):
    """Valid code that needs the start hooks: state created in ``on_fit_start`` / ``on_train_start`` /
    ``on_train_epoch_start`` / ``on_train_batch_start`` and read in ``training_step``; records every hook call."""

    def __init__(self):
        super().__init__(momentum=0.0)
        self.order: list[str] = []

    def on_fit_start(self):
        self.order.append("on_fit_start")
        self.scale = 1.0

    def on_train_start(self):
        self.order.append("on_train_start")
        self.seen_batches = 0

    def on_train_epoch_start(self):
        self.order.append("on_train_epoch_start")
        self.epoch_losses = []

    def on_train_batch_start(self, batch, batch_idx):
        self.order.append("on_train_batch_start")
        self.seen_batches += 1

    def training_step(self, batch, batch_idx):
        self.order.append("training_step")
        x, y = batch
        loss = F.cross_entropy(self(x), y) * self.scale
        self.epoch_losses.append(loss.detach())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.order.append("on_train_batch_end")

    def on_train_epoch_end(self):
        self.order.append("on_train_epoch_end")

    def on_train_end(self):
        self.order.append("on_train_end")

    def on_fit_end(self):
        self.order.append("on_fit_end")


class TwoTestSets(LitMLP):
    """Two test loaders (an in-distribution and a shifted set): ``test_step(batch, batch_idx, dataloader_idx=0)``."""

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y), batch_size=len(y))
        self.log("test_acc", (self(x).argmax(-1) == y).double().mean(), batch_size=len(y))


class TwoTestData:
    """A LightningDataModule's shape with two test loaders."""

    @staticmethod
    def make():
        import lightning.pytorch as pl

        class Data(pl.LightningDataModule):
            def setup(self, stage):
                x, y = blobs(40, seed=1)
                self.train = TensorDataset(x, y)
                self.train.targets = y
                self.near, self.far = TensorDataset(*blobs(20, seed=2)), TensorDataset(*blobs(12, seed=3))
                self.far.tensors = (self.far.tensors[0] + 2.0, self.far.tensors[1])

            def train_dataloader(self):
                return DataLoader(self.train, batch_size=5, shuffle=True)

            def test_dataloader(self):
                return [DataLoader(self.near, batch_size=8), DataLoader(self.far, batch_size=5)]

        return Data()


class Saved(LitMLP):
    """``save_hyperparameters()`` and ``on_save_checkpoint``, as a module that is reloaded with
    ``load_from_checkpoint`` is written."""

    def __init__(self, hidden: int = 16, lr: float = 0.2):
        super().__init__(lr=lr)
        self.save_hyperparameters()

    def on_save_checkpoint(self, checkpoint):
        checkpoint["vocabulary"] = ["a", "b"]

    def on_load_checkpoint(self, checkpoint):
        self.vocabulary = checkpoint["vocabulary"]


def _gan():
    from lit_gan import TinyGAN

    class ValidatedGAN(TinyGAN):
        """The tutorials' basic GAN: samples logged in ``training_step`` and, from a fixed ``validation_z``, in
        ``on_validation_epoch_end``; ``validation_step`` does nothing."""

        def __init__(self):
            super().__init__()
            self.validation_z = torch.randn(4, self.hparams.latent)

        def training_step(self, batch):
            z = torch.randn(2, self.hparams.latent).type_as(batch[0])
            self.logger.experiment.add_image("train/generated_images", self(z)[0], self.current_epoch)
            return super().training_step(batch)

        def validation_step(self, batch, batch_idx):
            pass

        def on_validation_epoch_end(self):
            z = self.validation_z.type_as(self.generator[0].weight)
            self.logger.experiment.add_image("validation/generated_images", self(z)[0], self.current_epoch)

    return ValidatedGAN()


class WithCallbacks(LitMLP):
    """``configure_callbacks`` as the Lightning docs write it."""

    def configure_callbacks(self):
        from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint

        return [EarlyStopping(monitor="val_acc", mode="max"), ModelCheckpoint(monitor="val_loss"),
                LearningRateMonitor(logging_interval="step")]


class OwnCallback(LitMLP):
    def configure_callbacks(self):
        from lightning.pytorch.callbacks import Callback

        class Printer(Callback):
            def on_train_epoch_end(self, trainer, pl_module):
                print("epoch done")

        return Printer()


class Clipping(LitMLP):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


class FewShotBatchSampler:
    """UvA-DL tutorial 12's sampler: each batch is ``N_way`` classes × ``K_shot`` examples (twice, support then
    query, with ``include_query``)."""

    def __init__(self, dataset_targets, N_way, K_shot, include_query=False, shuffle=True, shuffle_once=False):
        import numpy as np

        self.dataset_targets, self.N_way, self.K_shot = dataset_targets, N_way, K_shot
        self.shuffle, self.include_query = shuffle, include_query
        if self.include_query:
            self.K_shot *= 2
        self.batch_size = self.N_way * self.K_shot
        self.classes = torch.unique(self.dataset_targets).tolist()
        self.num_classes = len(self.classes)
        self.indices_per_class, self.batches_per_class = {}, {}
        for c in self.classes:
            self.indices_per_class[c] = torch.where(self.dataset_targets == c)[0]
            self.batches_per_class[c] = self.indices_per_class[c].shape[0] // self.K_shot
        self.iterations = sum(self.batches_per_class.values()) // self.N_way
        self.class_list = [c for c in self.classes for _ in range(self.batches_per_class[c])]
        if shuffle_once or self.shuffle:
            self.shuffle_data()
        else:
            sort_idxs = [i + p * self.num_classes for i, c in enumerate(self.classes)
                         for p in range(self.batches_per_class[c])]
            self.class_list = np.array(self.class_list)[np.argsort(sort_idxs)].tolist()

    def shuffle_data(self):
        import random

        for c in self.classes:
            perm = torch.randperm(self.indices_per_class[c].shape[0])
            self.indices_per_class[c] = self.indices_per_class[c][perm]
        random.shuffle(self.class_list)

    def __iter__(self):
        from collections import defaultdict

        if self.shuffle:
            self.shuffle_data()
        start_index = defaultdict(int)
        for it in range(self.iterations):
            class_batch = self.class_list[it * self.N_way:(it + 1) * self.N_way]
            index_batch = []
            for c in class_batch:
                index_batch.extend(self.indices_per_class[c][start_index[c]:start_index[c] + self.K_shot])
                start_index[c] += self.K_shot
            if self.include_query:
                index_batch = index_batch[::2] + index_batch[1::2]
            yield index_batch

    def __len__(self):
        return self.iterations


class ProtoNet(LitMLP):
    """Tutorial 12's ProtoNet: prototypes from the batch's support half classify its query half."""

    def __init__(self):
        super().__init__(classes=8, momentum=0.0)
        self.support_classes: list = []

    def training_step(self, batch, batch_idx):
        imgs, targets = batch
        features = self(imgs)
        support_feats, query_feats = features.chunk(2, dim=0)
        support_targets, query_targets = targets.chunk(2, dim=0)
        classes = torch.unique(support_targets)
        self.support_classes.append(sorted(support_targets.tolist()) == sorted(query_targets.tolist()))
        prototypes = torch.stack([support_feats[support_targets == c].mean(0) for c in classes])
        labels = (classes[None, :] == query_targets[:, None]).float().argmax(-1)
        logits = -torch.cdist(query_feats, prototypes) ** 2
        loss = F.cross_entropy(logits, labels)
        self.log("acc", (logits.argmax(-1) == labels).float().mean())
        return loss


def few_shot_data(shuffle: bool = True):
    import lightning.pytorch as pl

    class FewShot(pl.LightningDataModule):
        def setup(self, stage):
            x, y = blobs(96, classes=8, seed=4)
            self.train = TensorDataset(x, y)
            self.train.targets = y
            self.test = TensorDataset(*blobs(16, classes=8, seed=5))

        def train_dataloader(self):
            torch.manual_seed(0)  # shuffled once, at construction, identically for both runs
            random.seed(0)
            return DataLoader(self.train, batch_sampler=FewShotBatchSampler(
                self.train.targets, N_way=4, K_shot=2, include_query=True, shuffle=shuffle, shuffle_once=True))

        def test_dataloader(self):
            return DataLoader(self.test, batch_size=8)

    return FewShot()


class CutShort(StartState):
    """``on_train_batch_start`` returning -1 ends the epoch early (Lightning's documented meaning)."""

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        return -1 if batch_idx == 2 else None
