"""Published Lightning code that fedlight does not run as Lightning would is never trained differently in silence
(issue 59): each stand-in is written in its published module's idiom (lit_faithful.py), and what fedlight does is
either Lightning's Trainer's (equal to 1e-12 in 64-true), or one line before round 1 (a refusal or a note)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from lit_faithful import Compiled, StartState, TwoTestData, TwoTestSets, WarmupTransformer
from lit_twin import client_batches, trainer_fit
from test_lightning_optim import K, _equal_to_lightnings_trainer, _final, _fit1, _one_client

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.data import DataModuleClients, Dirichlet


def test_optimizer_step_overridden_is_called_with_the_closure_as_lightnings_trainer_calls_it(tmp_path, capsys):
    ours, got = _equal_to_lightnings_trainer(tmp_path, WarmupTransformer)  # tutorial 5: warm-up in optimizer_step
    err = "".join(capsys.readouterr())
    assert "WarmupTransformer.lr_scheduler, stepped in its optimizer_step, is replayed per client step" in err
    f = [0.5 * (1 + math.cos(math.pi * e / 50)) * e / 3 for e in range(3)]
    assert ours.lrs[:3] == pytest.approx([0.03 * x for x in f])  # the lr of the step taken: warming up from 0
    assert (got["net.0.weight"] - ours.init["net.0.weight"].double()).abs().max() > 1e-3  # it trained


def test_a_compiled_module_is_trained_as_the_module_with_its_optimizer_and_logs(tmp_path, capsys):
    torch.manual_seed(0)
    plain = Compiled()
    compiled = Compiled()
    compiled.load_state_dict(plain.state_dict())
    _fit1(tmp_path, plain, "plain")
    _fit1(tmp_path, torch.compile(compiled), "compiled")  # the Lightning docs' pattern
    assert "torch.compile(Compiled) is trained as the module itself" in capsys.readouterr().err
    for k, v in _final(tmp_path, "plain").items():
        torch.testing.assert_close(_final(tmp_path, "compiled")[k], v, rtol=0, atol=0)
    rows = [json.loads(line) for line in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    assert "train/train_acc" in rows[0] and "momentum=0.9" in rows[0].get("local_optimization", "momentum=0.9")


def test_a_module_carrying_its_data_wrapped_in_datamodule_clients_chooses_the_partition(tmp_path):
    from lit_trainer import OwnData

    model = OwnData(drop_last=False)
    data = DataModuleClients(model, num_clients=4, partition=Dirichlet(0.5))  # imagenet.py's route
    loop = LoopConfig(rounds=1, clients_per_round=2, local_steps=2, progress=False)
    summary = fedlight.fit(model, data, loop=loop, out_dir=str(tmp_path / "run"))
    assert summary["rounds_completed"] == 1 and data.num_clients == 4
    assert [s[0] for s in model.seen_setup].count("fit") == 1  # setup once per stage, with self.trainer


def test_start_hooks_run_before_the_one_batch_check_and_every_hook_in_the_trainers_order(tmp_path):
    ours, theirs = StartState(), StartState()
    theirs.load_state_dict(ours.state_dict())
    _fit1(tmp_path, ours)  # the check of one batch needs on_fit_start's self.scale and the others' state
    trainer_fit(theirs, client_batches(_one_client(), K))
    assert ours.order == theirs.order  # each hook once, in the Trainer's order, on the module that trains
    assert ours.order[:4] == ["on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start"]
    assert ours.order[-3:] == ["on_train_epoch_end", "on_train_end", "on_fit_end"]
    assert ours.seen_batches == K


def test_final_model_ckpt_loads_with_load_from_checkpoint_as_the_same_model_and_is_sealed(tmp_path):
    from lit_faithful import Saved

    from fedlight.run.verify import check_run

    _fit1(tmp_path, Saved(lr=0.1))
    path = tmp_path / "run" / "final_model.ckpt"
    loaded = Saved.load_from_checkpoint(path)  # Lightning's own loader: no KeyError 'pytorch-lightning_version'
    assert loaded.hparams.lr == 0.1 and loaded.vocabulary == ["a", "b"]
    raw = torch.load(path, weights_only=False)["state_dict"]
    for k, v in _final(tmp_path).items():  # the final model (trained in 64-true; loaded in the module's float32)
        torch.testing.assert_close(raw[k], v, rtol=0, atol=0)
        torch.testing.assert_close(loaded.state_dict()[k], v.to(loaded.state_dict()[k].dtype), rtol=0, atol=0)
    assert ("ok", "final_model.ckpt", "") in check_run(tmp_path / "run")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert any(f[:2] == ("damaged", "final_model.ckpt") for f in check_run(tmp_path / "run"))


def test_every_test_loader_is_evaluated_and_logged_with_lightnings_dataloader_idx_names(tmp_path):
    ours, theirs = TwoTestSets(), TwoTestSets()
    theirs.load_state_dict(ours.state_dict())
    data = DataModuleClients(TwoTestData.make(), num_clients=1)
    loop = LoopConfig(rounds=1, clients_per_round=1, local_steps=K, progress=False)
    summary = fedlight.fit(ours, data, loop=loop, precision="64-true", out_dir=str(tmp_path / "run"))
    dm = TwoTestData.make()
    dm.setup("test")
    trainer_fit(theirs, client_batches(DataModuleClients(TwoTestData.make(), num_clients=1), K))
    import lightning.pytorch as pl

    expected = pl.Trainer(accelerator="cpu", precision="64-true", logger=False, enable_progress_bar=False,
                          enable_model_summary=False).test(theirs, dm.test_dataloader(), verbose=False)
    expected = {k: v for d in expected for k, v in d.items()}
    assert set(expected) == {f"test_{m}/dataloader_idx_{i}" for m in ("loss", "acc") for i in (0, 1)}
    for k, v in expected.items():
        assert summary[f"final_{k}"] == pytest.approx(v, rel=1e-12, abs=1e-12)


def test_validation_epoch_hooks_follow_each_rounds_evaluation_and_training_images_come_from_training(tmp_path):
    from lit_faithful import _gan
    from lit_gan import TinyImages
    from test_lightning_trainer import _events

    loop = LoopConfig(rounds=2, clients_per_round=2, local_steps=3, progress=False)
    fedlight.fit(_gan(), DataModuleClients(TinyImages(), num_clients=2), loop=loop, out_dir=str(tmp_path / "run"))
    events = _events(tmp_path / "run")
    assert [e.step for e in events.Images("validation/generated_images")] == [0, 1]  # after each round's evaluation
    assert len(events.Images("train/generated_images")) == 2 * 2 * 3  # rounds × clients × steps: training only


def test_configure_callbacks_each_said_at_round_level_and_others_refused_before_round_1(tmp_path, capsys):
    from lit_faithful import Clipping, OwnCallback, WithCallbacks

    from fedlight.errors import ConfigError

    _fit1(tmp_path, WithCallbacks())
    out = "".join(capsys.readouterr())
    assert "WithCallbacks.configure_callbacks() EarlyStopping: not applied: a client's epoch is a few local" in out
    assert "ModelCheckpoint: fedlight writes RUN/checkpoints/last.ckpt" in out
    assert "LearningRateMonitor: the lr of each round's first local step is the `lr` column" in out
    assert "lr" in json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    with pytest.raises(ConfigError, match=r"returns Printer, whose hooks fedlight does not call"):
        _fit1(tmp_path, OwnCallback(), "own")
    _equal_to_lightnings_trainer(tmp_path / "clip", Clipping)  # called after on_before_optimizer_step, as the Trainer
    with pytest.raises(ConfigError, match=r"Clipping.configure_gradient_clipping clips the gradients itself, and "
                                          r"`loop.max_grad_norm` 1 would clip them before it"):
        _fit1(tmp_path, Clipping(), "clip_twice", max_grad_norm=1.0)
    from lit import BlobsDataModule

    class Augmenting(BlobsDataModule):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return batch[0] * 2, batch[1]

    with pytest.raises(ConfigError, match=r"Augmenting.on_after_batch_transfer: fedlight moves the batches"):
        fedlight.fit(WithCallbacks(), Augmenting(), loop=LoopConfig(rounds=1, clients_per_round=1, local_steps=1),
                     out_dir=str(tmp_path / "aug"))


def test_a_loaders_batch_sampler_makes_the_batches_as_in_lightnings_trainer(tmp_path):
    from lit_faithful import ProtoNet, few_shot_data

    from fedlight.errors import ConfigError

    ours, theirs = ProtoNet(), ProtoNet()
    theirs.load_state_dict(ours.state_dict())
    dm = few_shot_data(shuffle=False)
    dm.setup("fit")
    steps = len(dm.train_dataloader())  # one epoch of the sampler (5 batches)
    loop = LoopConfig(rounds=1, clients_per_round=1, local_steps=steps, progress=False)
    fedlight.fit(ours, DataModuleClients(few_shot_data(shuffle=False), num_clients=1), loop=loop,
                 precision="64-true", out_dir=str(tmp_path / "run"))
    trainer_fit(theirs, [tuple(t.double() if t.is_floating_point() else t for t in b) for b in dm.train_dataloader()])
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(_final(tmp_path)[k], v, rtol=0, atol=1e-12)
    assert ours.support_classes == [True] * steps  # support and query of the same 4 classes in every batch
    shuffled = ProtoNet()
    fedlight.fit(shuffled, DataModuleClients(few_shot_data(), num_clients=1), loop=loop, out_dir=str(tmp_path / "s"))
    assert shuffled.support_classes == [True] * steps
    with pytest.raises(ConfigError, match=r"draws its batches with its batch_sampler \(FewShotBatchSampler\) over the "
                                          r"whole train set, which fedlight follows for one client and cannot split "
                                          r"over 4: set `num_clients: 1`"):
        fedlight.fit(ProtoNet(), DataModuleClients(few_shot_data(), num_clients=4), loop=loop,
                     out_dir=str(tmp_path / "four"))


def test_on_train_batch_start_returning_minus_one_ends_the_clients_round_as_the_trainer_ends_the_epoch(tmp_path):
    from lit_faithful import CutShort

    ours, theirs = CutShort(), CutShort()
    theirs.load_state_dict(ours.state_dict())
    _fit1(tmp_path, ours)
    trainer_fit(theirs, client_batches(_one_client(), K))
    assert ours.order == theirs.order and ours.order.count("training_step") == 2
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(_final(tmp_path)[k], v, rtol=0, atol=1e-12)


def test_a_module_carrying_its_data_wrapped_in_datamodule_clients_from_the_command_line(tmp_path):
    from fedlight.config.cli import main

    args = ["fit", "--model", "lit_trainer.OwnData", "--data", "fedlight.data.DataModuleClients",
            "--data.init_args.datamodule", "lit_trainer.OwnData", "--data.init_args.num_clients", "4",
            "--loop.rounds", "1", "--loop.clients_per_round", "2", "--loop.local_steps", "2", "--loop.progress",
            "false", "--out_dir", str(tmp_path / "cli")]
    assert main(args) == 0  # imagenet.py's route (docs/lightning.md), no traceback
    assert json.loads((tmp_path / "cli" / "summary.json").read_text())["rounds_completed"] == 1
