"""A LightningModule's logs as Lightning gives them (issue 40): reduce_fx and on_step/on_epoch equal to Lightning's
own Trainer in 64-true, torchmetrics objects in training hooks, ``training_step(self, batch)``, the user's frames,
string labels, the forced-vmap note on dropout and the paper lr from Python."""

from __future__ import annotations

import json

import pytest
import torch
import torchmetrics
from lit import LitMLP, blobs
from lit_twin import client_batches, trainer_fit
from test_lightning_optim import K, _fit1, _one_client, _same_init
from torch.nn import functional as F

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.data import IID, DatasetClients, Dirichlet
from fedlight.errors import ConfigError


class Reducing(LitMLP):
    """Every reduce_fx, on_step/on_epoch combination and a torchmetrics object in training_step; sums in test."""

    def __init__(self):
        super().__init__()
        self.train_metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("seen", float(len(y)), on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("peak", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("low", loss, on_epoch=True, reduce_fx=torch.min)  # both: low_step and low_epoch
        self.log("avg", loss, on_step=False, on_epoch=True, batch_size=len(y) + batch_idx)  # weighted mean
        self.train_metric(logits, y)
        self.log("tm", self.train_metric, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        self.log("epoch_sum", 2.0, reduce_fx="sum")

    def test_step(self, batch, batch_idx):
        super().test_step(batch, batch_idx)
        self.log("test_n", 100.0, reduce_fx="sum")
        self.log("test_top", float(batch_idx), reduce_fx="max", prog_bar=True, sync_dist=True)
        self.log("test_stepwise", 1.0, on_step=True, on_epoch=False)


def test_reduce_fx_on_step_on_epoch_and_torchmetrics_equal_lightnings_trainer(tmp_path):
    ours, theirs = _same_init(Reducing)
    summary = _fit1(tmp_path, ours)
    data = _one_client()
    want = trainer_fit(theirs, client_batches(data, K), list(data.test_batches()))
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    for name in ("seen", "peak", "low_epoch", "avg", "tm", "epoch_sum"):
        assert row[f"train/{name}"] == pytest.approx(want[name], rel=1e-12, abs=1e-12), name
    assert row["train/seen"] == 30.0 and row["train/epoch_sum"] == 2.0
    assert 0 < row["train/low_step"]  # on_step: the mean over the round (Lightning keeps the last step in its metrics)
    assert "train/low" not in row and not any("stepwise" in k for k in [*row, *summary])  # forked; per-batch: none
    assert summary["final_test_n"] == want["test_n"] == 200.0  # 2 test batches; averaged this was 100
    assert summary["final_test_top"] == want["test_top"] == 1.0
    assert summary["final_test_acc"] == pytest.approx(want["test_acc"], abs=1e-7)
    sam = fedlight.fit(Reducing(), _one_client(), fedlight.create("fedsam"), loop=LoopConfig(
        rounds=1, clients_per_round=1, local_steps=K, progress=False), out_dir=str(tmp_path / "sam"))
    row = json.loads((tmp_path / "sam" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["train/seen"] == 30.0 and sam["final_test_n"] == 200.0  # SAM's second evaluation is not logged

    from fedlight.tasks.lightning.logs import capture_logs

    module = LitMLP()
    with pytest.raises(ConfigError, match=r"reduce_fx='median'\)`: Lightning supports mean, sum, max and min"):
        with capture_logs(module):
            module.log("x", 1.0, reduce_fx="median")


class NVFlareLike(LitMLP):
    """NVFlare's LitNet pattern: a torchmetrics object updated by forward and logged on_step (the default)."""

    def __init__(self):
        super().__init__()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc)
        self.log("train_acc_both", self.train_acc, on_epoch=True)
        return F.cross_entropy(logits, y)


def test_torchmetrics_objects_logged_in_training_step_are_kept(tmp_path):
    model = NVFlareLike()
    _fit1(tmp_path, model)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"train/train_acc", "train/train_acc_both_step", "train/train_acc_both_epoch"} <= row.keys()
    assert 0 < row["train/train_acc"] <= 1 and 0 < row["train/train_acc_both_epoch"] <= 1


class NoIndex(LitMLP):
    def training_step(self, batch):
        return F.cross_entropy(self(batch[0]), batch[1])

    def test_step(self, batch):
        self.log("test_loss", F.cross_entropy(self(batch[0]), batch[1]))


class Broken(LitMLP):
    def training_step(self, batch, batch_idx):
        return self.helper(batch)

    def helper(self, batch):
        return {"loss": batch[0].sum() + undefined_name}  # noqa: F821 - the user's bug


def test_a_step_without_batch_idx_runs_and_a_users_error_shows_their_frames(tmp_path):
    summary = _fit1(tmp_path, NoIndex())
    assert summary["final_test_loss"] > 0
    with pytest.raises(ConfigError) as e:
        _fit1(tmp_path, Broken(), name="broken")
    text = str(e.value)
    assert "Broken.training_step raised on the first batch, before round 1" in text
    assert "in helper" in text and "NameError: name 'undefined_name' is not defined" in text
    assert "input/output size" not in text and "fedlight/" not in text


class StringTargets(torch.utils.data.Dataset):
    def __init__(self, n=60, seed=1, with_targets=True):
        self.x, y = blobs(n, seed=seed)
        self.names = [("cat", "dog", "emu")[int(v)] for v in y]
        if with_targets:
            self.targets = self.names

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.names[i]


@pytest.mark.parametrize("how", ["iid", "dirichlet", "label_fn"])
def test_string_labels_are_mapped_to_class_indices_with_the_mapping_printed(tmp_path, capsys, how):
    kw = {"label_fn": lambda s: s[1]} if how == "label_fn" else {}
    data = DatasetClients(StringTargets(with_targets=how != "label_fn"), StringTargets(seed=2, with_targets=False),
                          num_clients=3, batch_size=5, partition=Dirichlet(1.0) if how == "dirichlet" else IID(),
                          **kw)
    summary = fedlight.fit({"class_path": "fedlight.models.MLP", "init_args": {"in_features": 8, "num_classes": 3}},
                           data, loop=LoopConfig(rounds=1, clients_per_round=2, local_steps=2, progress=False),
                           out_dir=str(tmp_path / how))
    assert "mapped to class indices {'cat': 0, 'dog': 1, 'emu': 2}" in capsys.readouterr().err
    assert 0 <= summary["final_test_acc"] <= 1
    bad = DatasetClients(StringTargets(), num_clients=2, label_fn=lambda s: (1, 2))
    with pytest.raises(ConfigError, match="pass `label_fn`"):
        bad.train.targets = [object()] * 60
        bad.setup()


def test_forcing_vmap_on_a_dropout_model_says_masks_differ(tmp_path, capsys):
    class Dropping(LitMLP):
        def __init__(self):
            super().__init__()
            self.net.insert(1, torch.nn.Dropout(0.2))

    fedlight.fit(Dropping(), _one_client(), loop=LoopConfig(rounds=1, clients_per_round=1, local_steps=2,
                                                              client_parallelism="vmap", progress=False),
                 out_dir=str(tmp_path / "v"))
    assert "draw their masks per stacked client, so the numbers differ from sequential" in "".join(
        capsys.readouterr())


def test_fit_from_python_takes_an_adaptive_rules_paper_lr(tmp_path, capsys):
    from fedlight.core.scale import scales_of

    paper = next(s.paper for s in scales_of(fedlight.create("fedadamw")) if s.key == "loop.lr")
    model = {"class_path": "fedlight.models.MLP", "init_args": {"in_features": 8, "num_classes": 3}}
    loop = LoopConfig(rounds=1, clients_per_round=1, local_steps=1, progress=False)
    with _no_scale_warning():
        fedlight.fit(model, _one_client(), fedlight.create("fedadamw"), loop=loop, out_dir=str(tmp_path / "a"))
    assert f"`loop.lr` set to {paper:g}, FedAdamW's paper value" in capsys.readouterr().err
    assert f"lr: {paper}" in (tmp_path / "a" / "config.yaml").read_text()
    chosen = LoopConfig(rounds=1, clients_per_round=1, local_steps=1, lr=0.05, progress=False)
    from fedlight.core.scale import ScaleWarning

    with pytest.warns(ScaleWarning):  # a value the caller chose is kept, with the warning
        fedlight.fit(model, _one_client(), fedlight.create("fedadamw"), loop=chosen, out_dir=str(tmp_path / "b"))
    assert "lr: 0.05" in (tmp_path / "b" / "config.yaml").read_text()


def _no_scale_warning():
    import warnings
    from contextlib import contextmanager

    from fedlight.core.scale import ScaleWarning

    @contextmanager
    def guard():
        with warnings.catch_warnings():
            warnings.simplefilter("error", ScaleWarning)
            yield

    return guard()
