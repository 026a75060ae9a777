"""A LightningModule's optimisation as its author wrote it (issue 40): gradient accumulation under manual
optimisation and several optimizers (equal to Lightning's own Trainer in 64-true), param groups, the lr actually
used, ``loop.max_grad_norm: auto`` and the task's local optimisation as one value."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from lit import LitMLP, Scheduled
from lit_twin import client_batches, trainer_fit
from torch.nn import functional as F

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.data import IID, DatasetClients
from fedlight.errors import ConfigError

K = 6


def _one_client(n: int = 30, batch_size: int = 5):
    from lit import blobs

    x, y = blobs(n, seed=1)
    train = torch.utils.data.TensorDataset(x, y)
    return DatasetClients(train, torch.utils.data.TensorDataset(*blobs(20, seed=2)), num_clients=1,
                          batch_size=batch_size, partition=IID(), eval_batch_size=10, num_classes=3)


def _fit1(tmp_path, model, name="run", **loop):
    """One client, one round: the client's local run is the whole run."""
    cfg = LoopConfig(**{"rounds": 1, "clients_per_round": 1, "local_steps": K, "progress": False, **loop})
    return fedlight.fit(model, _one_client(), loop=cfg, precision="64-true", out_dir=str(tmp_path / name))


def _final(tmp_path, name="run"):
    return torch.load(tmp_path / name / "final_model.pt", weights_only=True)


def _same_init(cls, *args):
    torch.manual_seed(0)
    a = cls(*args)
    b = cls(*args)
    b.load_state_dict(a.state_dict())
    a.init = {k: v.clone() for k, v in a.state_dict().items()}
    return a, b


def _equal_to_lightnings_trainer(tmp_path, cls):
    """One client's round of ``cls`` through fedlight and through Lightning's own Trainer from the same start: the
    final parameters agree to 1e-12 in 64-true; returns fedlight's module and final parameters."""
    ours, theirs = _same_init(cls)
    _fit1(tmp_path, ours)
    trainer_fit(theirs, client_batches(_one_client(), K))
    got = _final(tmp_path)
    for k, v in theirs.state_dict().items():
        if k in got:
            torch.testing.assert_close(got[k], v, rtol=0, atol=1e-12)
    return ours, got


class Accumulating(LitMLP):
    """The Lightning docs' idiom: backward of loss/N every batch, step and zero every N batches."""

    def __init__(self, every: int = 3):
        super().__init__(momentum=0.0)
        self.automatic_optimization, self.every = False, every

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.manual_backward(loss / self.every)
        if (batch_idx + 1) % self.every == 0:
            opt.step()
            opt.zero_grad()
        self.log("loss", loss)


def test_gradient_accumulation_under_manual_optimisation_equals_lightnings_trainer(tmp_path):
    ours, got = _equal_to_lightnings_trainer(tmp_path, Accumulating)
    assert (got["net.0.weight"] - ours.init["net.0.weight"].double()).abs().max() > 1e-3  # it trained


class TwoOptimizers(LitMLP):
    """A GAN's shape: two optimizers over two parts, unpacked from self.optimizers(), training_step(self, batch)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch):
        first, second = self.optimizers()
        x, y = batch
        for opt, part in ((first, self.net[0]), (second, self.net[2])):
            self.toggle_optimizer(opt)
            loss = F.cross_entropy(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.untoggle_optimizer(opt)
        self.log_dict({"loss_a": loss, "loss_b": loss * 2})

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net[0].parameters(), lr=0.3),
                torch.optim.Adam(self.net[2].parameters(), lr=1e-2, betas=(0.5, 0.9)))


def test_two_optimizers_under_manual_optimisation_equal_lightnings_trainer(tmp_path, capsys):
    ours, got = _equal_to_lightnings_trainer(tmp_path, TwoOptimizers)
    assert "SGD(lr=0.3, weight_decay=0) + Adam(lr=0.01, betas=(0.5, 0.9)" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"train/loss_a", "train/loss_b"} <= rows[0].keys()


class TwoAutomatic(TwoOptimizers):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = True

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])


def test_several_optimizers_need_manual_optimisation_and_shaping_rules_refuse(tmp_path):
    with pytest.raises(ConfigError, match=r"returns 2 optimizers, which Lightning, and fedlight, train only with "
                                          r"manual optimisation: set `self.automatic_optimization = False`"):
        _fit1(tmp_path, TwoAutomatic())
    with pytest.raises(ConfigError, match=r"manual optimisation .*fedavg.*FedSAM shapes it"):
        fedlight.fit(TwoOptimizers(), _one_client(), fedlight.create("fedsam"),
                     loop=LoopConfig(rounds=1, clients_per_round=1, local_steps=2, progress=False),
                     out_dir=str(tmp_path / "sam"))


class Grouped(LitMLP):
    """Weight decay on weights only, biases free of it and at another lr (the usual AdamW recipe, in SGD)."""

    def configure_optimizers(self):
        weights = [p for n, p in self.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in self.named_parameters() if n.endswith("bias")]
        return torch.optim.SGD([{"params": weights, "weight_decay": 0.1},
                                {"params": biases, "weight_decay": 0.0, "lr": 0.05}], lr=0.2, momentum=0.5)


def test_param_groups_are_honoured_as_lightnings_trainer_applies_them(tmp_path, capsys):
    ours, got = _equal_to_lightnings_trainer(tmp_path, Grouped)
    assert "param groups honoured: group 1 lr=0.05, weight_decay=0" in capsys.readouterr().out


@pytest.mark.parametrize("rule, why", [("scaffold", "SCAFFOLD's local algebra reads one local lr"),
                                       ("fedadamw", "FedAdamW builds its own local optimizer")])
def test_param_groups_a_rule_cannot_honour_are_refused_naming_the_group(tmp_path, rule, why):
    with pytest.raises(ConfigError, match=rf"param group 1 \(lr=0.05, weight_decay=0\) differs from group 0 "
                                          rf"\(lr=0.2, weight_decay=0.1\); {why}"):
        fedlight.fit(Grouped(), _one_client(), fedlight.create(rule),
                     loop=LoopConfig(rounds=1, clients_per_round=1, local_steps=2, progress=False),
                     out_dir=str(tmp_path / rule))


def test_the_lr_column_is_the_lr_the_round_used(tmp_path):
    for interval, want in (("epoch", [(0.2, None), (0.1, None), (0.05, None)]),
                           ("step", [(0.2, 0.2 * (1 - 5 / 18)), (0.2 * (1 - 6 / 18), 0.2 * (1 - 11 / 18)),
                                     (0.2 * (1 - 12 / 18), 0.2 * (1 - 17 / 18))])):
        cfg = LoopConfig(rounds=3, clients_per_round=1, local_steps=K, progress=False)
        fedlight.fit(Scheduled(interval), _one_client(), loop=cfg, out_dir=str(tmp_path / interval))
        rows = [json.loads(line) for line in (tmp_path / interval / "metrics.jsonl").read_text().splitlines()]
        got = [(r["lr"], r.get("lr_last")) for r in rows if "lr" in r]
        for (lr, last), (want_lr, want_last) in zip(got, want, strict=True):
            assert lr == pytest.approx(want_lr, rel=1e-12)
            assert (last is None) == (want_last is None) and (last is None or last == pytest.approx(want_last))


def test_max_grad_norm_auto_clips_fedlights_models_at_10_and_a_number_clips_every_model(tmp_path):
    from fedlight.core.loop_config import AUTO_CLIP

    assert LoopConfig().max_grad_norm == "auto" and LoopConfig().clip_norm == AUTO_CLIP == 10.0
    assert LoopConfig(max_grad_norm=3.0).clip_norm == 3.0 and LoopConfig(max_grad_norm=None).clip_norm is None
    with pytest.raises(ConfigError, match="`loop.max_grad_norm` must be positive, auto or null, got 'off'"):
        LoopConfig(max_grad_norm="off")
    task = fedlight.tasks.Task()
    algorithm = fedlight.create("fedavg")
    local = task.local_optimization(None, torch.nn.Linear(2, 2), algorithm, LoopConfig())
    assert (local.loop, local.algorithm, local.optimizer, local.effective) == (LoopConfig(), algorithm, None, None)
    with pytest.raises(AttributeError):
        local.loop = None  # a frozen value


def test_a_gan_written_as_lightnings_example_runs_under_fedavg_from_the_command_line(tmp_path, capsys):
    from fedlight.config.cli import main

    recipe = tmp_path / "gan.yaml"
    recipe.write_text("model: {class_path: lit_gan.TinyGAN}\n"
                      "data:\n  class_path: fedlight.data.DataModuleClients\n  init_args:\n"
                      "    datamodule: {class_path: lit_gan.TinyImages}\n    num_clients: 4\n"
                      "loop: {rounds: 2, clients_per_round: 2, local_steps: 3, progress: false}\n")
    assert main(["fit", "--config", str(recipe), "--out_dir", str(tmp_path / "gan")]) == 0
    out = "".join(capsys.readouterr())
    assert "Adam(lr=0.002, betas=(0.5, 0.999)" in out and "+ Adam(lr=0.002" in out
    assert "evaluated by what training_step logs on the test set (`test_d_loss`, `test_g_loss`" in out
    rows = [json.loads(line) for line in (tmp_path / "gan" / "metrics.jsonl").read_text().splitlines()]
    assert {"train/d_loss", "train/g_loss", "test_d_loss", "test_g_loss"} <= rows[-1].keys()
    torch.manual_seed(0)  # the CLI builds the model after seeding with the run's seed 0
    from lit_gan import TinyGAN

    start, final = TinyGAN().state_dict(), _final(tmp_path, "gan")
    for part in ("generator.0.weight", "discriminator.0.weight"):  # both optimizers stepped their parts
        assert (final[part] - start[part]).abs().max() > 1e-4


def test_which_rules_bring_their_own_optimizer_is_decided_in_one_place():
    own = {n for n in ("fedavg", "scaffold", "fedsam", "fedswa", "fedmoswa", "fedadamw", "local_adam", "fedlada")
           if fedlight.create(n).local.brings_optimizer}
    assert own == {"fedadamw", "local_adam", "fedlada"}  # FedSWA's in-round lr steps the loop's (the module's) SGD


class ManualScheduled(LitMLP):
    """Manual optimisation stepping its scheduler itself: every batch (the Lightning docs' idiom), or not at all; the
    config's ``interval`` is what fedlight follows."""

    def __init__(self, interval: str | None = None, calls: bool = True):
        super().__init__(momentum=0.0)
        self.automatic_optimization, self.interval, self.steps_scheduler = False, interval, calls

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))
        opt.step()
        if self.steps_scheduler:
            self.lr_schedulers().step()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return [opt], [sched] if self.interval is None else [{"scheduler": sched, "interval": self.interval}]


def test_a_manual_loops_scheduler_calls_are_followed_by_their_interval_and_a_mismatch_is_said_once(tmp_path, capsys):
    """Under manual optimisation Lightning steps a scheduler only when the module calls ``step()``; fedlight steps it
    by its ``interval``. Calls that match the interval train as Lightning's Trainer (to 1e-12); calls that do not
    (per batch under the default ``epoch`` interval, or none) are said in one line naming the interval that matches."""
    stepped = functools.partial(ManualScheduled, "step")
    ours, got = _equal_to_lightnings_trainer(tmp_path, stepped)
    assert (got["net.0.weight"] - ours.init["net.0.weight"].double()).abs().max() > 1e-3
    assert "manual optimisation: the module called" not in capsys.readouterr().out
    for name, module, calls, fix in (("every_batch", ManualScheduled(), K, '"interval": "step", "frequency": 1'),
                                     ("never", ManualScheduled("step", calls=False), 0, "remove it")):
        data = _one_client()
        cfg = LoopConfig(rounds=2, clients_per_round=1, local_steps=K, progress=False)
        fedlight.fit(module, data, loop=cfg, precision="64-true", out_dir=str(tmp_path / name))
        out = capsys.readouterr().out
        assert out.count("manual optimisation: the module called") == 1, out
        assert f"StepLR.step() {calls} time(s) in a client's round 1 of {K} steps" in out and fix in out, out


@pytest.mark.parametrize("cls", [Accumulating, TwoOptimizers, ManualScheduled])
def test_manual_optimisation_on_the_streams_runner_equals_sequential(tmp_path, cls):
    """The streams runner (each client's own step, its generator travelling with it) runs a module that steps its own
    optimizers exactly as the sequential runner: final model and every logged value bitwise, over 2 rounds × 3
    clients (on CPU the streams runner runs the clients one after another through its own code)."""
    from lit import blobs

    runs = {}
    for mode in ("sequential", "streams"):
        torch.manual_seed(0)
        x, y = blobs(60, seed=1)
        data = DatasetClients(torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(*blobs(20, seed=2)),
                              num_clients=3, batch_size=5, partition=IID(), eval_batch_size=10, num_classes=3)
        cfg = LoopConfig(rounds=2, clients_per_round=3, local_steps=K, progress=False, client_parallelism=mode)
        fedlight.fit(cls(), data, loop=cfg, precision="64-true", out_dir=str(tmp_path / mode))
        rows = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        skip = ("rss_mb", "chain")
        runs[mode] = _final(tmp_path, mode), [{k: v for k, v in r.items() if "time" not in k and k not in skip}
                                              for r in rows]
    (seq, seq_rows), (par, par_rows) = runs["sequential"], runs["streams"]
    assert seq.keys() == par.keys() and all(torch.equal(seq[k], par[k]) for k in seq)
    assert seq_rows == par_rows
