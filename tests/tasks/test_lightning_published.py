"""Lightning code as people write it: published modules run unchanged, the module's own schedule, trainer state
and hooks behave as in a hand-written loop (64-true), and fedlight changes nothing of the optimisation silently."""

from __future__ import annotations

import json

import pytest
import torch
from lit import BlobsDataModule, LitMLP, Scheduled
from test_lightning import K, R, _by_hand, _data, _fit

import fedlight
from fedlight.data import IID, DataModuleClients
from fedlight.errors import ConfigError


def _final(tmp_path, name="run"):
    return torch.load(tmp_path / name / "final_model.pt", weights_only=True)


def _close(got, want):
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-10)


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_the_modules_schedule_trainer_state_and_epoch_hooks_equal_a_hand_loop(tmp_path, capsys, interval):
    lr_at = (lambda r, k: 0.2 * (1 - (r * K + k) / (R * K))) if interval == "step" else (lambda r, k: 0.2 * 0.5**r)
    torch.manual_seed(0)
    model = Scheduled(interval)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    # an in-round cosine asked of the loop does not apply on top of the module's own schedule
    summary = _fit(tmp_path, model, loop={"local_lr_schedule": "cosine"})
    err = "".join(capsys.readouterr())
    assert "replayed per client step r·K+k; `loop.lr_schedule` and `loop.local_lr_schedule` do not apply" in err
    seen = model.seen  # (the probe calls training_step on a copy)
    assert [(e, s) for e, s, _ in seen] == [(r, r * K + k) for r in range(R) for _ in range(3) for k in range(K)]
    assert [lr for *_, lr in seen] == pytest.approx([lr_at(r, k) for r in range(R) for _ in range(3)
                                                     for k in range(K)], abs=1e-12)
    norms = []
    twin = Scheduled(interval)
    twin.load_state_dict(init)
    twin.optimizers = lambda: torch.optim.SGD([torch.zeros(1)], lr=0.0)  # what it records is not compared
    want = _by_hand(twin, _data(), lr_at, after_client=lambda m: norms.append(float(m.net[0].weight.norm())))
    _close(_final(tmp_path), want)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r, row in enumerate(rows):
        assert row["train/epoch_end_step"] == (r + 1) * K
        assert row["train/w_norm"] == pytest.approx(sum(norms[3 * r:3 * r + 3]) / 3, abs=1e-10)
        assert row["test_epoch"] == r
    assert summary["final_test_epoch"] == R - 1


class Skipping(LitMLP):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else out


def _fit_and_twin(tmp_path, model, **attrs):
    """Fit ``model`` (with ``attrs`` set) from seed 0's init; return a plain LitMLP twin at that init."""
    torch.manual_seed(0)
    model = model()
    for k, v in attrs.items():
        setattr(model, k, v)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    _fit(tmp_path, model)
    twin = LitMLP()
    twin.load_state_dict(init)
    for k, v in attrs.items():
        setattr(twin, k, v)
    return twin


def test_training_step_returning_none_skips_the_step(tmp_path):
    """Without momentum, a skipped step is an SGD step at lr 0 in the hand loop."""
    twin = _fit_and_twin(tmp_path, Skipping, momentum=0.0)
    _close(_final(tmp_path), _by_hand(twin, _data(), lambda r, k: 0.0 if k == 1 else 0.2))


class Manual(LitMLP):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)["loss"]
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


def test_manual_optimisation_under_fedavg_equals_a_hand_loop_and_shaping_rules_refuse(tmp_path):
    twin = _fit_and_twin(tmp_path, Manual)
    _close(_final(tmp_path), _by_hand(twin, _data()))
    with pytest.raises(ConfigError, match="manual optimisation .* fedadam, fedavg, fedavgm. SCAFFOLD shapes it"):
        _fit(tmp_path, Manual(), name="scaffold", algorithm=fedlight.create("scaffold"))


def test_a_pytorch_lightning_classifier_and_data_module_train_by_their_own_steps(tmp_path, capsys):
    pytest.importorskip("pytorch_lightning")
    from lit_pl import LitNet, PLBlobs

    torch.manual_seed(0)
    model = LitNet()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    data = lambda: DataModuleClients(PLBlobs(), num_clients=6, partition=__import__(  # noqa: E731
        "fedlight.data", fromlist=["Dirichlet"]).Dirichlet(0.5))
    summary = fedlight.fit(model, data(), loop=_loop(), precision="64-true", out_dir=str(tmp_path / "run"))
    assert "local optimizer from LitNet.configure_optimizers(): SGD(lr=0.05, momentum=0.9" in \
        "".join(capsys.readouterr())
    assert summary["headline"]["metric"] == "test_accuracy"
    twin = LitNet()
    twin.load_state_dict(init)
    _close(_final(tmp_path), _by_hand(twin, data()))


def test_a_pytorch_lightning_autoencoder_ignoring_labels_runs_with_its_adam(tmp_path, capsys):
    pytest.importorskip("pytorch_lightning")
    from lit_pl import LitAutoEncoder, PLBlobs

    torch.manual_seed(0)
    summary = fedlight.fit(LitAutoEncoder(), PLBlobs(), loop=_loop(), out_dir=str(tmp_path / "ae"))
    assert "local optimizer from LitAutoEncoder.configure_optimizers(): Adam(lr=0.01" in "".join(capsys.readouterr())
    assert summary["headline"]["metric"] == "test_loss" and summary["final_test_loss"] < summary["best_test_loss"] * 2


def _loop(**kw):
    from fedlight.core.loop_config import LoopConfig

    return LoopConfig(rounds=R, clients_per_round=3, local_steps=K, progress=False, **kw)


def _loss_on_test(module, batches):
    """The batch-size-weighted mean of ``training_step``'s loss (Lightning's on-epoch reduction)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for i, b in enumerate(batches):
            out = module.training_step(b, i)
            size = len(b[0] if isinstance(b, (list, tuple)) else b)
            total, n = total + float(out["loss"] if isinstance(out, dict) else out) * size, n + size
    return total / n


@pytest.mark.parametrize("demo", ["BoringModel", "DemoModel"])
def test_lightnings_demo_modules_run_unchanged_and_are_evaluated_by_their_training_loss(tmp_path, capsys, demo):
    from lightning.pytorch import demos

    torch.manual_seed(0)
    model = getattr(demos, demo)()
    dm = demos.BoringDataModule()
    data = DataModuleClients(dm, num_clients=4, batch_size=8, partition=IID())
    summary = fedlight.fit(model, data, loop=_loop(), out_dir=str(tmp_path / demo))
    assert "is evaluated by training_step's loss on the test set (`test_loss`)" in "".join(capsys.readouterr())
    model.load_state_dict(_final(tmp_path, demo))
    test = dm.random_full.data[128:192]  # BoringDataModule's test split, in its test loader's batches of 1
    assert summary["final_test_loss"] == pytest.approx(_loss_on_test(model, test.split(1)), rel=1e-5)


def test_lightning_transformer_demo_on_procedural_tokens(tmp_path):
    from lightning.pytorch.demos import LightningTransformer
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 20, (64, 9), generator=g)
    train = TensorDataset(tokens[:48, :-1], tokens[:48, 1:])
    test = TensorDataset(tokens[48:, :-1], tokens[48:, 1:])
    torch.manual_seed(0)
    data = fedlight.data.DatasetClients(train, test, num_clients=4, batch_size=4, partition=IID())
    summary = fedlight.fit(LightningTransformer(vocab_size=20), data, loop=_loop(), out_dir=str(tmp_path / "t"))
    assert summary["headline"]["metric"] == "test_loss"
    model = LightningTransformer(vocab_size=20)
    model.load_state_dict(_final(tmp_path, "t"))
    model.eval()  # equal-size test samples: the batch-weighted mean is the mean over the whole test set
    whole = [t.contiguous() for t in test.tensors]
    assert summary["final_test_loss"] == pytest.approx(_loss_on_test(model, [whole]), rel=1e-5)


@pytest.mark.parametrize("problem, match", [
    ("frozen", "has no trainable parameter"),
    ("attribute", "`self.trainer.fit_loop` is not available under fedlight"),
    ("plateau", "ReduceLROnPlateau, which fedlight cannot replay"),
])
def test_refusals_name_the_problem_before_round_1(tmp_path, problem, match):
    model = LitMLP()
    if problem == "frozen":
        model.requires_grad_(False)
    if problem == "attribute":
        model = type("Reads", (LitMLP,), {"training_step": lambda self, b, i: self.trainer.fit_loop})()
    if problem == "plateau":
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}
        model = type("Plateau", (LitMLP,), {"configure_optimizers": configure_optimizers})()
    with pytest.raises(ConfigError, match=match):
        _fit(tmp_path, model)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_stacked_equals_sequential_with_a_schedule_and_hooks(tmp_path):
    finals = {}
    for mode in ("sequential", "vmap"):
        torch.manual_seed(0)
        _fit(tmp_path, Scheduled("step"), name=mode, algorithm=fedlight.create("scaffold"),
             loop={"client_parallelism": mode})
        finals[mode] = _final(tmp_path, mode)
    _close(finals["vmap"], finals["sequential"])


def test_an_unused_default_clip_is_not_applied_and_an_explicit_one_is(tmp_path, capsys):
    torch.manual_seed(0)
    init = LitMLP().state_dict()
    for name, clip in (("default", "auto"), ("none", None), ("tight", 0.01), ("ten", 10.0)):
        m = LitMLP()
        m.load_state_dict(init)
        _fit(tmp_path, m, name=name, loop={"max_grad_norm": clip})
    err = "".join(capsys.readouterr())
    assert "gradient clip 0.01 (`loop.max_grad_norm`)" in err and "gradient clip 10 (`loop.max_grad_norm`)" in err
    assert err.count("no gradient clip (`loop.max_grad_norm: auto` clips only fedlight's own models") == 2
    _close(_final(tmp_path, "default"), _final(tmp_path, "none"))
    assert not torch.equal(_final(tmp_path, "tight")["net.0.weight"], _final(tmp_path, "none")["net.0.weight"])


__all__ = ["BlobsDataModule"]


class FailsInRound2(Scheduled):
    fail = True

    def on_train_epoch_start(self):
        if self.fail and self.current_epoch == 1:
            raise ValueError("my hook broke")


def test_an_exception_in_the_users_hook_keeps_round_1_and_resume_continues_bitwise(tmp_path):
    from fedlight.tasks.lightning.errors import UserCodeError

    torch.manual_seed(0)
    model = FailsInRound2()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserCodeError) as e:
        _fit(tmp_path, model)
    text = str(e.value)
    assert "in on_train_epoch_start" in text and "ValueError: my hook broke" in text and "fedlight/" not in text
    assert "rounds 1-1 are kept" in text and "`--resume auto` to continue exactly from round 2" in text
    assert e.value.status == 1
    again = FailsInRound2()
    again.load_state_dict(init)  # the architecture; the parameters come from the checkpoint
    again.fail = False
    _fit(tmp_path, again, resume="auto")
    whole = Scheduled()
    whole.load_state_dict(init)
    _fit(tmp_path, whole, name="whole")
    a, b = _final(tmp_path), _final(tmp_path, "whole")
    assert all(torch.equal(a[k], b[k]) for k in b)


class Frozen(LitMLP):
    def __init__(self):
        super().__init__()
        self.requires_grad_(False)


class StringLabels(torch.utils.data.Dataset):
    def __init__(self, n=60):
        from lit import blobs

        self.x, self.y = blobs(n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], ("cat", "dog", "emu")[int(self.y[i])]


@pytest.mark.parametrize("model", ["lit.LitMLP", "fedlight.models.MLP"])
def test_string_labels_are_refused_with_the_mapping_to_write(tmp_path, model):
    from fedlight.data import DatasetClients

    data = DatasetClients(StringLabels(), StringLabels(), num_clients=4, partition=IID(), batch_size=5)
    spec = {"class_path": model, "init_args": {} if model.startswith("lit") else {"in_features": 8, "num_classes": 3}}
    with pytest.raises(ConfigError, match=r"labels are strings \('cat', 'dog', 'emu', ...\).*class_to_idx"):
        fedlight.fit(spec, data, loop=_loop(), out_dir=str(tmp_path / "s"))


def test_the_command_line_nested_datamodule_flags_and_exit_statuses(tmp_path, capsys):
    from fedlight.config.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {class_path: lit.LitMLP}\n"
                      "data:\n  class_path: fedlight.data.DataModuleClients\n  init_args:\n"
                      "    datamodule: {class_path: lit.BlobsDataModule, init_args: {batch_size: 6}}\n"
                      "    num_clients: 6\n"
                      "loop: {rounds: 2, clients_per_round: 2, local_steps: 2, progress: false}\n")
    args = ["fit", "--config", str(recipe), "--out_dir"]
    assert main([*args, str(tmp_path / "a"), "--data.init_args.datamodule.init_args.batch_size", "16"]) == 0
    assert "batch_size: 16" in (tmp_path / "a" / "config.yaml").read_text()
    assert main([*args, str(tmp_path / "b"), "--model", "test_lightning_published.Frozen"]) == 2
    assert "has no trainable parameter" in capsys.readouterr().err
    assert main([*args, str(tmp_path / "c"), "--model", "test_lightning_published.FailsInRound2"]) == 1
    err = capsys.readouterr().err
    assert "ValueError: my hook broke" in err and "rounds 1-1 are kept" in err


class Ramp(LitMLP):
    """SGD whose lr grows 30-fold per epoch (round): it diverges after the first round."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        return [opt], [torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 30.0 ** epoch)]


class LitAdam(LitMLP):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=30.0)


def test_a_rule_written_for_sgd_refuses_the_modules_adam_and_the_divergence_names_the_modules_optimizer(tmp_path,
                                                                                                          capsys):
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match=r"FedWMSAM's local algebra is written for plain SGD steps, and the "
                                          r"module's Adam \(from configure_optimizers\) would rescale each coordinate"):
        _fit(tmp_path, LitAdam(), algorithm=fedlight.create("fedwmsam"), loop={"rounds": 4})  # before round 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    _fit(tmp_path, Ramp(), name="sgd", algorithm=fedlight.create("fedwmsam"), loop={"rounds": 4})
    err = "".join(capsys.readouterr())
    assert "training is diverging. Likely cause: the module's local optimizer SGD at lr 0.5 (from " \
           "Ramp.configure_optimizers()) may be too large for FedWMSAM" in err
    assert "`loop.lr` = 0.1" not in err
    summary = json.loads((tmp_path / "sgd" / "summary.json").read_text())
    assert summary["local_optimization"].startswith("local optimizer from Ramp.configure_optimizers(): SGD(lr=0.5")
    assert "# fedlight: local optimization used: local optimizer from Ramp" in \
        (tmp_path / "sgd" / "config.yaml").read_text()


class BuiltLate(LitMLP):
    """Builds its layers in configure_model, as large-model code does; reads the trainer there."""

    def __init__(self):
        super().__init__()
        del self.net

    def configure_model(self):
        self.rounds_seen_at_build = self.trainer.max_epochs
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.built = self.net[0].weight.detach().clone()


def test_configure_model_builds_the_layers_before_the_optimizer(tmp_path):
    torch.manual_seed(0)
    model = BuiltLate()
    _fit(tmp_path, model)
    assert model.rounds_seen_at_build == R
    assert set(_final(tmp_path)) >= {"net.0.weight", "net.2.bias"}
    assert not torch.allclose(_final(tmp_path)["net.0.weight"], model.built.double())  # the built layers trained
