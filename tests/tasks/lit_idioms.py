"""Lightning idioms as its documentation and tutorials write them, each in a tiny module (64-true comparisons with
Lightning's own Trainer in test_lightning_idioms.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lit import LitMLP, blobs
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class Steps(LitMLP):
    """Records ``self.global_step`` at each training_step and ``trainer.global_step`` at each on_train_batch_end."""

    def __init__(self, **kwargs):
        super().__init__(momentum=0.0, **kwargs)
        self.at_step: list[int] = []
        self.at_end: list[int] = []

    def training_step(self, batch, batch_idx):
        self.at_step.append(self.global_step)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.at_end.append(self.trainer.global_step)


class AccumulatingSteps(Steps):
    """The Lightning docs' manual gradient accumulation over 2 batches."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        self.at_step.append(self.global_step)
        opt = self.optimizers()
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.manual_backward(loss / 2)
        if (batch_idx + 1) % 2 == 0:
            opt.step()
            opt.zero_grad()


class GANSteps(Steps):
    """The docs' two-optimizer shape: each training_step steps both (toggled)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch):
        self.at_step.append(self.global_step)
        x, y = batch
        for opt in self.optimizers():
            self.toggle_optimizer(opt)
            loss = F.cross_entropy(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net[0].parameters(), lr=0.3), torch.optim.SGD(self.net[2].parameters(), lr=0.1)


class Outputs(LitMLP):
    """``on_train_batch_end`` reads ``outputs["loss"]`` (training_step returns a tensor, or a dict with more keys)."""

    def __init__(self, as_dict: bool = False):
        super().__init__()
        self.as_dict, self.seen = as_dict, []

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        return {"loss": loss, "n": len(batch[1])} if self.as_dict else loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append((sorted(outputs), float(outputs["loss"]), outputs.get("n")))
        self.log("batch_end_loss", outputs["loss"])


class BadBatchEnd(LitMLP):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        return outputs["logits"]  # not what training_step returns: fails at the first batch


class LBFGSModule(LitMLP):
    """``torch.optim.LBFGS`` under automatic optimisation: Lightning's closure re-runs training_step."""

    def __init__(self):
        super().__init__()
        self.evaluations, self.ends = 0, []

    def training_step(self, batch, batch_idx):
        self.evaluations += 1
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("lbfgs_loss", loss, on_step=False, on_epoch=True)  # every closure call logs, as in Lightning
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ends.append(float(outputs["loss"]) if outputs else None)  # the last closure call's loss

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)


class ManualLBFGS(LBFGSModule):
    """The docs' manual optimisation "closure for LBFGS-like optimizers"."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()

        def closure():
            loss = F.cross_entropy(self(batch[0]), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure)
        self.evaluations += 0  # (closure() counts nothing; training_step runs once a batch)


class ManualClip(LitMLP):
    """Manual optimisation clipping with ``self.clip_gradients``, verbatim from the docs."""

    def __init__(self, algorithm: str = "norm"):
        super().__init__(momentum=0.0)
        self.automatic_optimization, self.algorithm = False, algorithm

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm=self.algorithm)
        opt.step()


class FitState(LitMLP):
    """State created in ``on_fit_start`` and read in ``test_step``."""

    def on_fit_start(self):
        self.scale = torch.tensor(2.0, dtype=self.dtype)

    def test_step(self, batch, batch_idx):
        self.log("scaled_loss", self.scale * F.cross_entropy(self(batch[0]), batch[1]))


class Counting(LitMLP):
    """Keeps a counter of its training steps in its own checkpoint, and counts the data module's epochs there."""

    fail = False

    def __init__(self):
        super().__init__()
        self.seen = 0

    def on_train_epoch_start(self):
        if self.fail and self.current_epoch == 1:
            raise ValueError("stopped in round 2")

    def training_step(self, batch, batch_idx):
        self.seen += 1
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self):
        self.trainer.datamodule.epochs += 1

    def on_save_checkpoint(self, checkpoint):
        checkpoint["seen"] = self.seen

    def on_load_checkpoint(self, checkpoint):
        self.seen = checkpoint["seen"]


class StatefulData(pl.LightningDataModule):
    """A data module with state (``state_dict`` / ``load_state_dict``)."""

    def __init__(self):
        super().__init__()
        self.epochs = 0

    def setup(self, stage):
        x, y = blobs(60, seed=1)
        self.train = TensorDataset(x, y)
        self.train.targets = y
        self.test = TensorDataset(*blobs(20, seed=2))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=5, shuffle=True)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=10)

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


class TrainerReads(LitMLP):
    """Idioms of the docs and tutorials that read the module's and the trainer's state in training_step:
    ``self.device`` / ``self.dtype`` for new tensors, the loss weighted by ``self.current_epoch`` over
    ``self.trainer.max_epochs`` and by ``self.trainer.num_training_batches``, ``self.print`` and a rank-0 guard."""

    def __init__(self):
        super().__init__(momentum=0.0)
        self.printed = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = torch.full_like(x, 0.01) * torch.ones(1, device=self.device, dtype=self.dtype)
        weight = (1 + self.current_epoch) / self.trainer.max_epochs * 6 / self.trainer.num_training_batches
        if self.trainer.is_global_zero and self.global_rank == 0 and batch_idx == 0:
            self.print(f"epoch {self.current_epoch} starts")
            self.printed += 1
        return weight * F.cross_entropy(self(x + noise), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        gathered = self.all_gather(F.cross_entropy(self(x), y))
        self.log("test_loss", gathered.mean(), sync_dist=True)


class Monitored(LitMLP):
    """A StepLR returned with a ``monitor`` key (Lightning accepts it for any scheduler)."""

    def __init__(self):
        super().__init__(momentum=0.0)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "monitor": "train_acc"}}


class Freezing(LitMLP):
    """The fine-tuning idiom: the first layer frozen during the first epoch, unfrozen after (with weight decay, which
    Lightning's optimizer does not apply to a parameter without gradient)."""

    def __init__(self):
        super().__init__(momentum=0.0)

    def on_train_epoch_start(self):
        self.net[0].requires_grad_(self.current_epoch > 0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, weight_decay=0.1)


class OwnSchedulerStep(LitMLP):
    def lr_scheduler_step(self, scheduler, metric):
        scheduler.step(epoch=self.current_epoch)


class Predicting(LitMLP):
    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)


class EveryHook(LitMLP):
    """Records every per-step training hook (with the global_step it sees), automatic or manual optimisation."""

    def __init__(self, manual: bool = False):
        super().__init__(momentum=0.0)
        self.automatic_optimization, self.order = not manual, []

    def _record(self, name):
        self.order.append((name, self.global_step))

    def on_train_epoch_start(self):
        self._record("on_train_epoch_start")

    def on_train_batch_start(self, batch, batch_idx):
        self._record("on_train_batch_start")

    def on_before_zero_grad(self, optimizer):
        self._record("on_before_zero_grad")

    def on_before_backward(self, loss):
        self._record("on_before_backward")

    def on_after_backward(self):
        self._record("on_after_backward")

    def on_before_optimizer_step(self, optimizer):
        self._record("on_before_optimizer_step")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._record("on_train_batch_end")

    def on_train_epoch_end(self):
        self._record("on_train_epoch_end")

    def training_step(self, batch, batch_idx):
        self._record("training_step")
        loss = F.cross_entropy(self(batch[0]), batch[1])
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss
