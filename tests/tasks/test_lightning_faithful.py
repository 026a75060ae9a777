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
