"""Lightning's documented idioms run as the Trainer runs them: ``global_step`` counts optimizer steps in both
optimisation modes, ``on_train_batch_end`` gets Lightning's outputs (and runs in the check of one batch), closure
optimizers, ``clip_gradients``, state from ``on_fit_start`` in the evaluation, a module's own checkpoint state through
``--resume``, and more idioms of the docs and tutorials: each equal to Lightning's Trainer on the same module (64-true,
1e-12), or refused / noted in one line."""

from __future__ import annotations

import json

import pytest
import torch
from lit_idioms import (
    AccumulatingSteps,
    BadBatchEnd,
    Counting,
    EveryHook,
    FitState,
    Freezing,
    GANSteps,
    LBFGSModule,
    ManualClip,
    ManualLBFGS,
    Monitored,
    Outputs,
    OwnSchedulerStep,
    Predicting,
    StatefulData,
    Steps,
    TrainerReads,
)
from lit_twin import client_batches, trainer_fit
from test_lightning_optim import K, _final, _fit1, _one_client, _same_init

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.data import IID, DataModuleClients
from fedlight.errors import ConfigError


def _twins(tmp_path, cls, rounds: int = 1, test: bool = False, **loop):
    """``cls`` through fedlight (one client, ``rounds`` rounds) and through Lightning's Trainer (one epoch a round, on
    the same batches), from the same start; the final parameters agree to 1e-12 (64-true). Returns both modules and
    the Trainer's metrics."""
    ours, theirs = _same_init(cls)
    _fit1(tmp_path, ours, rounds=rounds, **loop)
    batches = [client_batches(_one_client(), K, round=r) for r in range(rounds)]
    if test:
        data = _one_client()
        data.input_dtype = torch.float64
        data.setup("cpu", 0)
        tests = list(data.test_batches())
    else:
        tests = None
    metrics = trainer_fit(theirs, batches[0], tests, later=tuple(batches[1:]))
    got = _final(tmp_path)
    for k, v in theirs.state_dict().items():
        if k in got:
            torch.testing.assert_close(got[k], v.double(), rtol=0, atol=1e-12)
    assert (got["net.0.weight"] - ours.init["net.0.weight"].double()).abs().max() > 1e-4  # it trained
    return ours, theirs, metrics


def _rows(tmp_path, name="run"):
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ global_step
@pytest.mark.parametrize("cls", [Steps, AccumulatingSteps, GANSteps])
def test_global_step_is_lightnings_count_of_optimizer_steps_in_both_modes(tmp_path, cls):
    """Automatic: one a batch; manual accumulation over 2 batches: one every 2; two optimizers: two a batch; over
    2 rounds, as a Trainer fitting the client 2 epochs counts them."""
    ours, theirs, _ = _twins(tmp_path, cls, rounds=2)
    assert ours.at_step == theirs.at_step and ours.at_end == theirs.at_end
    want = {Steps: list(range(2 * K)), AccumulatingSteps: [i // 2 for i in range(2 * K)],
            GANSteps: list(range(0, 4 * K, 2))}[cls]
    assert theirs.at_step == want


@pytest.mark.parametrize("manual", [False, True])
def test_every_step_hook_in_the_trainers_order_with_its_global_step_in_both_modes(tmp_path, manual):
    ours, theirs, _ = _twins(tmp_path, lambda: EveryHook(manual), rounds=2)
    assert ours.order == theirs.order
    assert ("on_after_backward", 0) in theirs.order and ("on_train_batch_end", 2 * K) in theirs.order


# ------------------------------------------------------------------------------------------------ on_train_batch_end
@pytest.mark.parametrize("as_dict", [False, True])
def test_on_train_batch_end_gets_what_lightning_passes(tmp_path, as_dict):
    ours, theirs, _ = _twins(tmp_path, lambda: Outputs(as_dict))
    assert [s[0] for s in ours.seen[-K:]] == [["loss", "n"] if as_dict else ["loss"]] * K
    got, want = ours.seen[-K:], theirs.seen
    assert [(k, n) for k, _, n in got] == [(k, n) for k, _, n in want]
    assert [v for _, v, _ in got] == pytest.approx([v for _, v, _ in want], abs=1e-12)
    assert _rows(tmp_path)[0]["train/batch_end_loss"] == pytest.approx(sum(v for _, v, _ in want) / K, abs=1e-12)


def test_a_module_failing_in_on_train_batch_end_fails_before_round_1_with_its_own_error(tmp_path):
    with pytest.raises(ConfigError, match=r"raised on the first batch, before round 1:(.|\n)*in on_train_batch_end"
                                          r"(.|\n)*KeyError: 'logits'"):
        _fit1(tmp_path, BadBatchEnd())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------ closure optimizers
@pytest.mark.parametrize("cls", [LBFGSModule, ManualLBFGS])
def test_closure_optimizers_run_with_lightnings_closure_in_both_modes(tmp_path, cls):
    ours, theirs, metrics = _twins(tmp_path, cls)
    if cls is LBFGSModule:  # each closure call re-ran training_step (the check of one batch runs on a copy)
        assert ours.evaluations == theirs.evaluations > K
        assert ours.ends == pytest.approx(theirs.ends, abs=1e-12) and len(theirs.ends) == K
        assert _rows(tmp_path)[0]["train/lbfgs_loss"] == pytest.approx(metrics["lbfgs_loss"], abs=1e-12)


def test_a_closure_optimizer_under_a_rule_shaping_the_step_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"LBFGSModule.configure_optimizers\(\) returns LBFGS, whose step "
                                          r"re-evaluates the loss through a closure; FedSAM shapes the local step"):
        fedlight.fit(LBFGSModule(), _one_client(), fedlight.create("fedsam"),
                     loop=LoopConfig(rounds=1, clients_per_round=1, local_steps=2, progress=False),
                     out_dir=str(tmp_path / "sam"))


def test_a_failure_in_fedlights_own_code_says_so_in_a_fedlight_line(tmp_path, capsys, monkeypatch):
    import functools

    from fedlight.tasks.lightning import errors, hooks

    # a bug of fedlight's own: the exception raised in fedlight's code, no frame of the user's on the way
    broken = functools.partial(errors._reraise, RuntimeError("internal"))
    monkeypatch.setattr(hooks.ClientHooks, "end", staticmethod(broken))
    with pytest.raises(RuntimeError, match="internal"):
        _fit1(tmp_path, Steps())
    assert ("fedlight: the run failed inside fedlight or a library it calls, not in your code (RuntimeError: "
            "internal); no round had finished, so nothing is kept. Please report it") in capsys.readouterr().err
    from fedlight.tasks.lightning import optim

    monkeypatch.setattr(optim, "_check_clipping", None)  # the same before round 1: a TypeError in fedlight's code
    with pytest.raises(TypeError, match="not callable"):
        _fit1(tmp_path, Steps(), "before")
    assert "fedlight: the run failed inside fedlight or a library it calls" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ clip_gradients
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clip_gradients_in_manual_optimisation_clips_as_lightning(tmp_path, algorithm):
    ours, _, _ = _twins(tmp_path, lambda: ManualClip(algorithm))
    unclipped, _ = _same_init(lambda: ManualClip(algorithm))
    unclipped.clip_gradients = lambda *a, **k: None
    _fit1(tmp_path, unclipped, "unclipped")
    assert (_final(tmp_path)["net.0.weight"] - _final(tmp_path, "unclipped")["net.0.weight"]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------ fit, then test
def test_state_made_in_on_fit_start_is_there_for_test_step_as_in_fit_then_test(tmp_path):
    ours, theirs, metrics = _twins(tmp_path, FitState, test=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_test_scaled_loss"] == pytest.approx(metrics["scaled_loss"], abs=1e-12)


# ------------------------------------------------------------------------------------------------ checkpoints
def _counting(tmp_path, name, fail=False, resume=None):
    torch.manual_seed(0)
    data = StatefulData()
    model = Counting()
    model.fail = fail
    cfg = LoopConfig(rounds=2, clients_per_round=3, local_steps=4, progress=False)
    kw = {"resume": resume} if resume else {}
    fedlight.fit(model, DataModuleClients(data, num_clients=3, partition=IID()), loop=cfg, precision="64-true",
                 out_dir=str(tmp_path / name), **kw)
    return model, data


def test_a_modules_checkpoint_state_and_its_data_modules_survive_a_resume_and_reach_final_model_ckpt(tmp_path):
    from fedlight.tasks.lightning.errors import UserCodeError

    whole, whole_data = _counting(tmp_path, "whole")
    assert (whole.seen, whole_data.epochs) == (2 * 3 * 4, 2 * 3)
    with pytest.raises(UserCodeError, match="stopped in round 2"):
        _counting(tmp_path, "stopped", fail=True)
    again, again_data = _counting(tmp_path, "stopped", resume="auto")
    assert (again.seen, again_data.epochs) == (whole.seen, whole_data.epochs)  # not 12 and 3: round 1's were given back
    ckpt = torch.load(tmp_path / "stopped" / "final_model.ckpt", weights_only=False)
    assert (ckpt["seen"], ckpt["StatefulData"]) == (24, {"epochs": 6})
    last = torch.load(tmp_path / "stopped" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["task"]["extras"] == {"StatefulData": {"epochs": 6}, "seen": 24}
    # Lightning's Trainer writes the same keys for the same module and data module
    import lightning.pytorch as pl

    module, data = Counting(), StatefulData()
    trainer = pl.Trainer(max_epochs=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(tmp_path / "trainer.ckpt")
    theirs = torch.load(tmp_path / "trainer.ckpt", weights_only=False)
    assert {k for k in theirs if k in ("seen", "StatefulData")} == {k for k in ckpt if k in ("seen", "StatefulData")}
    assert theirs["StatefulData"] == {"epochs": data.epochs} and theirs["seen"] == module.seen


# ------------------------------------------------------------------------------------------------ further idioms
@pytest.mark.parametrize("cls", [TrainerReads, Monitored, Freezing])
def test_further_idioms_equal_lightnings_trainer_over_two_rounds(tmp_path, capsys, cls):
    ours, theirs, metrics = _twins(tmp_path, cls, rounds=2, test=cls is TrainerReads)
    if cls is TrainerReads:
        assert ours.printed == theirs.printed == 2
        assert capsys.readouterr().out.count("epoch 1 starts") >= 1
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["final_test_loss"] == pytest.approx(metrics["test_loss"], abs=1e-12)


def test_lr_scheduler_step_is_refused_and_predict_step_noted_in_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"OwnSchedulerStep.lr_scheduler_step: fedlight replays schedulers by their "
                                          r"own step\(\)"):
        _fit1(tmp_path, OwnSchedulerStep())
    _fit1(tmp_path, Predicting(), "predict")
    err = "".join(capsys.readouterr())
    assert err.count("Predicting: fedlight does not predict: predict_step (and the predict hooks) are not called") == 1
