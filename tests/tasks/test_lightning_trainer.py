"""Published Lightning code that leans on the Trainer's machinery runs unchanged (issue 51): ``self.logger`` is the
run's TensorBoard, a module's own data hooks are the data (with ``self.trainer.strategy`` in ``setup``),
``is_last_batch`` is the client's last step, the author's ``drop_last`` and string labels are kept, a bare
``pytorch_lightning`` DataModule works from the command line, and a schedule sized for other epochs is said."""

from __future__ import annotations

import json

import pytest
import torch
from lit import LitMLP
from lit_trainer import Drawing, LastBatch, Named, Names, OneCycle, OwnData
from lit_twin import client_batches, trainer_fit
from test_lightning import _fit
from test_lightning_optim import K, _equal_to_lightnings_trainer, _final, _fit1

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.data import DataModuleClients, DatasetClients, Dirichlet
from fedlight.errors import ConfigError
from fedlight.tasks.lightning.loggers import RunLoggers
from fedlight.tasks.lightning.module_data import ModuleData
from fedlight.tasks.lightning.trainer import PROVIDED, FedTrainer, NotUnderFedlight


def _events(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_self_logger_is_the_runs_tensorboard_and_images_land_at_the_step_given(tmp_path):
    model = Drawing()
    _fit(tmp_path, model)  # 3 rounds
    events = _events(tmp_path / "run")
    assert sorted({e.step for e in events.Images("weights")}) == [0, 1, 2]  # self.current_epoch: the round r
    assert model.logger is None  # detached after the run
    trainer = FedTrainer(model, 1, 1, run_loggers=RunLoggers(None))
    assert trainer.logger is None and trainer.loggers == []  # outside a run: none, as Lightning with logger=False


def test_loggers_list_tensorboard_then_the_trackers_and_write_the_run(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    seen = {}

    class Listing(LitMLP):
        def on_train_epoch_end(self):
            seen["loggers"] = [type(lg) for lg in self.loggers]
            self.loggers[0].log_metrics({"mine/norm": self.net[0].weight.norm().item()}, step=self.current_epoch + 1)

        def on_train_start(self):  # the idiom of Lightning's TensorBoard docs (hp_metric)
            self.logger.log_hyperparams({"width": 16}, {"hp/metric": 0})

    _fit(tmp_path, Listing(), loggers=["tensorboard", "csv"])
    assert issubclass(seen["loggers"][0], TensorBoardLogger) and seen["loggers"][1] is CSVLogger
    events = _events(tmp_path / "run")
    assert [e.step for e in events.Scalars("mine/norm")] == [1] * 3 + [2] * 3 + [3] * 3  # 3 clients a round
    assert [e.value for e in events.Scalars("hp/metric")] == [0]
    assert "width: 16" in (tmp_path / "run" / "tb" / "hparams.yaml").read_text()
    seen.clear()

    class Counting(LitMLP):
        def on_train_epoch_end(self):
            seen["loggers"], seen["logger"] = self.loggers, self.logger

    _fit(tmp_path, Counting(), name="none", loggers="none")
    assert seen == {"loggers": [], "logger": None}  # no TensorBoard asked for: as Trainer(logger=False)
    with pytest.raises(ConfigError, match=r"`self.logger` is None because the run writes no TensorBoard \(`--loggers` "
                       r"without tensorboard\), as with Trainer\(logger=False\); add tensorboard"):
        _fit(tmp_path, Drawing(), name="refused", loggers="none")


def test_a_modules_own_data_hooks_are_the_data_with_drop_last_and_the_trainers_strategy(tmp_path, capsys):
    torch.manual_seed(0)
    model = OwnData()  # 70 samples over 10 IID clients: 7 each, one more than the batch of 6
    summary = fedlight.fit(model, loop=LoopConfig(rounds=2, clients_per_round=2, local_steps=3, progress=False),
                           out_dir=str(tmp_path / "own"))
    err = capsys.readouterr().err
    assert "OwnData's own train_dataloader split into 10 IID clients" in err
    assert model.seen_setup[0] == ("fit", "SingleDeviceStrategy", 1, 0, 0)
    assert [s[0] for s in model.seen_setup].count("fit") == 1  # setup("fit") once, as Lightning calls it
    assert 0 <= summary["final_test_acc"] <= 1
    assert "data: null" in (tmp_path / "own" / "config.yaml").read_text()
    same = OwnData()
    fedlight.fit(same, same, loop=LoopConfig(rounds=1, clients_per_round=2, local_steps=1, progress=False),
                 out_dir=str(tmp_path / "same"))  # fit(model, model), as Trainer.fit(model, datamodule=model) reads
    assert [s[0] for s in same.seen_setup] == ["fit", "test", "validate"]  # no test_dataloader: val_dataloader
    data = DataModuleClients(ModuleData(OwnData()), num_clients=10)
    data.setup("cpu", 0)
    assert data.batch_sizes(0, 3) == (6, 6, 6) and data.steps_per_epoch(0) == 1  # no 1-sample batch
    loose = DataModuleClients(ModuleData(OwnData(drop_last=False)), num_clients=10)
    loose.setup("cpu", 0)
    assert loose.batch_sizes(0, 3) == (6, 1, 6)


def test_drop_last_batches_equal_lightnings_trainer_on_the_same_module(tmp_path):
    """One client of 13 samples, batch 6, drop_last: two batches an epoch, as Lightning's loader gives."""
    torch.manual_seed(0)
    ours, theirs = OwnData(n_train=13), OwnData(n_train=13)
    theirs.load_state_dict(ours.state_dict())
    data = lambda: DataModuleClients(ModuleData(OwnData(n_train=13)), num_clients=1)  # noqa: E731
    cfg = LoopConfig(rounds=1, clients_per_round=1, local_epochs=1, progress=False)
    fedlight.fit(ours, data(), loop=cfg, precision="64-true", out_dir=str(tmp_path / "run"))
    batches = client_batches(data(), 2)
    assert [len(b[1]) for b in batches] == [6, 6]
    trainer_fit(theirs, batches)
    got = _final(tmp_path)
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-12)


def test_is_last_batch_steps_at_the_clients_last_batch_as_lightnings_trainer(tmp_path):
    ours, _ = _equal_to_lightnings_trainer(tmp_path, LastBatch)
    assert ours.last[-K:] == [False] * (K - 1) + [True]


def test_string_labels_reach_the_module_as_its_loader_yields_them(tmp_path, capsys):
    data = DatasetClients(Names(), Names(30, seed=2), num_clients=3, batch_size=5, partition=Dirichlet(1.0))
    summary = fedlight.fit(Named(), data, loop=LoopConfig(rounds=1, clients_per_round=2, local_steps=2,
                                                           progress=False), out_dir=str(tmp_path / "n"))
    err = capsys.readouterr().err
    assert "read as classes {'cat': 0, 'dog': 1, 'emu': 2} to split the clients; the batches keep them" in err
    assert 0 <= summary["final_test_acc"] <= 1
    assert data.client_labels(0).dtype == torch.int64  # the partition read the names through the mapping


def test_a_bare_pytorch_lightning_datamodule_from_the_command_line(tmp_path):
    pytest.importorskip("pytorch_lightning")
    from fedlight.config.cli import main

    args = ["fit", "--model", "lit_pl.LitNet", "--data", "lit_pl.PLBlobs", "--loop.rounds", "1",
            "--loop.clients_per_round", "2", "--loop.local_steps", "2", "--loop.progress", "false"]
    assert main([*args, "--out_dir", str(tmp_path / "pl")]) == 0
    assert "lit_pl.PLBlobs" in (tmp_path / "pl" / "config.yaml").read_text()
    own = ["fit", "--model", "lit_trainer.OwnData", *args[5:], "--out_dir", str(tmp_path / "own")]  # no --data
    assert main(own) == 0
    assert json.loads((tmp_path / "own" / "summary.json").read_text())["rounds_completed"] == 1
    assert main(["fit", "--model", "fedlight.models.MLP", *args[5:], "--out_dir", str(tmp_path / "no")]) == 2


def test_a_schedule_sized_for_other_epochs_is_said_before_round_1(tmp_path, capsys):
    _fit1(tmp_path, OneCycle())
    err = "".join(capsys.readouterr())
    assert ("OneCycleLR (total_steps=50) is sized for 50 steps, but a client takes 6 steps per round and the run 1 "
            "rounds: 6 steps in all, so the run takes 12.0% of it") in err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["lr"] == pytest.approx(0.1 / 25)  # OneCycle's start: max_lr / div_factor
    short = OneCycle()
    short.steps_per_epoch = 4  # 4 steps a round for 1 round, where a client takes 6: it would step past its end
    with pytest.raises(ConfigError, match=r"OneCycleLR \(total_steps=4\) is sized for 4 steps.*it ends after 4 of "
                       "the run's 6.*cannot step past its total_steps"):
        _fit1(tmp_path, short, name="short")


def test_the_docs_table_lists_every_attribute_the_stand_in_answers_with_its_value(tmp_path):
    import re
    from pathlib import Path

    from lightning.pytorch.loggers import TensorBoardLogger

    from fedlight.run.record import RunRecord

    table = (Path(__file__).parents[2] / "docs" / "lightning.md").read_text()
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "`trainer." in
            line.split(" | ")[0]]
    listed = {n for row in rows for n in re.findall(r"`(?:trainer\.)?([a-z_]+)`", row)}
    assert listed == set(PROVIDED)
    module, record = Drawing(), RunRecord(tmp_path / "r")
    trainer = FedTrainer(module, rounds=3, steps=4, datamodule="dm", run_loggers=RunLoggers(record))
    want = {"max_epochs": 3, "max_steps": 12, "estimated_stepping_batches": 12, "num_training_batches": 4,
            "is_last_batch": False, "world_size": 1, "num_devices": 1, "global_rank": 0, "local_rank": 0,
            "is_global_zero": True, "num_nodes": 1, "node_rank": 0, "precision": "32-true", "callback_metrics": {},
            "logged_metrics": {}, "lightning_module": module, "optimizers": [], "lr_scheduler_configs": [],
            "datamodule": "dm", "training": False, "testing": False, "validating": False, "sanity_checking": False,
            "accumulate_grad_batches": 1, "fast_dev_run": False, "progress_bar_callback": None, "global_step": 0,
            "current_epoch": 0, "gradient_clip_val": None, "gradient_clip_algorithm": None}
    assert {k: getattr(trainer, k) for k in want} == want
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"
    assert isinstance(trainer.logger, TensorBoardLogger) and trainer.loggers == [trainer.logger]
    assert type(trainer.logger.experiment).__name__ == "_DummyExperiment"  # the run's files are not open yet
    assert type(trainer.precision_plugin).__name__ == "Precision"  # Lightning's, for self.clip_gradients
    assert set(want) | {"strategy", "logger", "loggers", "precision_plugin"} == set(PROVIDED)
    with pytest.raises(NotUnderFedlight, match="`self.trainer.fit_loop` is not available under fedlight"):
        trainer.fit_loop
