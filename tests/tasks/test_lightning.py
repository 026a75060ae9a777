"""A LightningModule and a LightningDataModule federated as they are: their training_step, test_step and
configure_optimizers are provably the ones used (call counts; numbers equal a hand-written Fabric loop in 64-true)."""

from __future__ import annotations

import json
import warnings

import lightning as L
import pytest
import torch
from lit import BlobsDataModule, LitMLP

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.core.sampling import client_generator, sample_clients
from fedlight.data import DataModuleClients, Dirichlet
from fedlight.errors import ConfigError

N, S, K, R = 6, 3, 4, 3


def _data():
    return DataModuleClients(BlobsDataModule(), num_clients=N, partition=Dirichlet(0.5))


def _cfg(**kw):
    return LoopConfig(**{"rounds": R, "clients_per_round": S, "local_steps": K, "max_grad_norm": None,
                         "progress": False, **kw})


def _fit(tmp_path, model, name="run", **kw):
    return fedlight.fit(model, _data(), loop=_cfg(**kw.pop("loop", {})), precision="64-true",
                        out_dir=str(tmp_path / name), **kw)


def _by_hand(model: LitMLP, data, lr_at=None, after_client=None) -> dict[str, torch.Tensor]:
    """FedAvg written out with Fabric: the module's own optimizer and training_step over the same batches;
    ``lr_at(r, k)``: the lr of step ``k`` of round ``r`` (default the module's); ``after_client(model)``: called
    after each client's last step."""
    fabric = L.Fabric(accelerator="cpu", precision="64-true")
    model = fabric.strategy.precision.convert_module(model)
    data.input_dtype = torch.float64
    data.setup("cpu", 0)
    x = {k: v.detach().clone() for k, v in model.named_parameters()}
    for r in range(R):
        deltas, weights = [], []
        for c in sample_clients(N, S, 0, r):
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(x[k])
            opt = torch.optim.SGD(model.parameters(), lr=model.lr, momentum=model.momentum)
            for k, batch in enumerate(data.client_batches(c, K, client_generator(0, r, c))):
                for group in opt.param_groups:
                    group["lr"] = lr_at(r, k) if lr_at is not None else model.lr
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # self.log without a Trainer: not what is tested here
                    out = model.training_step(batch, k)
                    loss = out["loss"] if isinstance(out, dict) else out
                opt.zero_grad()
                loss.backward()
                opt.step()
            if after_client is not None:
                after_client(model)
            deltas.append({k: p.detach() - x[k] for k, p in model.named_parameters()})
            weights.append(data.num_samples(c))
        total = sum(weights)
        x = {k: x[k] + sum(w / total * d[k] for w, d in zip(weights, deltas)) for k in x}
    return x


def test_training_step_optimizer_and_test_step_are_the_ones_used(tmp_path, capsys):
    torch.manual_seed(0)
    model = LitMLP()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = _fit(tmp_path, model)
    assert not [w for w in caught if "log" in str(w.message)]  # no Lightning warning about a missing Trainer
    # call counts: K steps × S clients × R rounds (the probe's training_step runs on a copy, after the start hooks);
    # configure_optimizers once; test_step per test batch (3 batches of 20) per round (the probe's on a copy)
    assert model.calls == {"training_step": K * S * R, "configure_optimizers": 1, "test_step": 3 * R}
    assert model.batch_indices == list(range(K)) * S * R  # batch_idx is the client's local step
    err = "".join(capsys.readouterr())
    assert "local optimizer from LitMLP.configure_optimizers(): SGD(lr=0.2, momentum=0.5" in err

    torch.manual_seed(0)
    twin = LitMLP()
    twin.load_state_dict(init)
    want = _by_hand(twin, _data())
    got = torch.load(tmp_path / "run" / "final_model.pt", weights_only=True)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-10)

    # evaluation: what test_step logs, reduced over the whole test set (accuracy object computed once)
    twin.load_state_dict({**got}, strict=False)
    data = _data()
    data.setup("cpu", 0)
    xs, ys = zip(*data.test_batches())
    with torch.no_grad():
        logits = twin.net.double()(torch.cat(xs).double())
    y = torch.cat(ys)
    acc = float((logits.argmax(-1) == y).double().mean())
    loss = float(torch.nn.functional.cross_entropy(logits, y))
    assert summary["headline"] == {"metric": "test_acc", "higher_is_better": True}
    assert summary["final_test_acc"] == pytest.approx(acc, abs=1e-7)  # torchmetrics keeps float32
    assert summary["final_test_loss"] == pytest.approx(loss, abs=1e-9)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert 0 <= rows[-1]["train/train_acc"] <= 1  # self.log in training_step: a per-client training metric


@pytest.mark.parametrize("form", ["list", "lists", "dicts"])
def test_configure_optimizers_list_forms(form):
    from fedlight.tasks.lightning.schedule import read_configure_optimizers

    class Lit(LitMLP):
        def configure_optimizers(self):
            a = torch.optim.SGD(self.parameters(), lr=0.3)
            b = torch.optim.Adam(self.parameters(), lr=0.1)
            if form == "dicts":
                return [{"optimizer": a, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(a, 1),
                                                          "interval": "step", "frequency": 2}}, {"optimizer": b}]
            return [a, b] if form == "list" else ([a, b], [torch.optim.lr_scheduler.StepLR(a, 1)])

    optimizers, configs = read_configure_optimizers(Lit().configure_optimizers(), "Lit")
    assert [type(o) for o in optimizers] == [torch.optim.SGD, torch.optim.Adam]
    assert [(c["interval"], c["frequency"]) for c in configs] == {
        "list": [], "lists": [("epoch", 1)], "dicts": [("step", 2)]}[form]


def test_a_rule_with_its_own_optimizer_keeps_it_and_says_so(tmp_path, capsys):
    model = LitMLP()
    _fit(tmp_path, model, algorithm=fedlight.create("local_adamw"), loop={"lr": 1e-3, "weight_decay": 0.0})
    assert model.calls["configure_optimizers"] == 1  # read for its param groups only
    assert "LocalAdamW prescribes its own local optimizer; LitMLP.configure_optimizers() is not used" in \
        "".join(capsys.readouterr())


def test_stacked_equals_sequential_for_a_lightning_module(tmp_path):
    finals = {}
    for mode in ("sequential", "vmap"):
        torch.manual_seed(0)
        _fit(tmp_path, LitMLP(), name=mode, algorithm=fedlight.create("scaffold"),
             loop={"client_parallelism": mode})
        finals[mode] = torch.load(tmp_path / mode / "final_model.pt", weights_only=True)
    for k in finals["sequential"]:
        torch.testing.assert_close(finals["vmap"][k], finals["sequential"][k], rtol=0, atol=1e-10)


def test_a_lightning_datamodule_is_used_as_it_is(tmp_path):
    dm = BlobsDataModule()
    torch.manual_seed(0)
    a = fedlight.fit(LitMLP(), dm, loop=_cfg(), out_dir=str(tmp_path / "a"))
    assert dm.stages[:2] == ["prepare", "fit"] and "test" in dm.stages
    assert dm.collated > K * S * R  # every client batch went through the datamodule's own collate
    torch.manual_seed(0)
    b = fedlight.fit(LitMLP(), BlobsDataModule(), loop=_cfg(), out_dir=str(tmp_path / "b"))
    assert a["final_test_acc"] == b["final_test_acc"] and a["final_train_loss"] == b["final_train_loss"]


@pytest.mark.parametrize("problem, match", [
    ("no_training_step", "has no training_step"),
    ("per_sample_loss", "must return a scalar loss"),
])
def test_bad_lightning_modules_are_refused_before_round_1(tmp_path, problem, match):
    model = LitMLP(per_sample_loss=problem == "per_sample_loss")
    if problem == "no_training_step":
        model = type("NoStep", (LitMLP,), {"training_step": L.pytorch.LightningModule.training_step})()
    with pytest.raises(ConfigError, match=match):
        _fit(tmp_path, model)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_custom_rule_may_set_its_own_objective_on_both_runners(tmp_path):
    """A rule that swaps ``ctx.objective`` for one calling the module's training_step runs stacked too (the
    stacked runner binds each client's tensors to any method of the model, not only forward)."""
    from fedlight import Algorithm, LocalUpdateRule
    from fedlight.core import params as P
    class OwnObjective(LocalUpdateRule):
        def start(self, model, ctx):
            super().start(model, ctx)
            ctx.objective = lambda m, batch: 2.0 * m.training_step(batch, 0)["loss"]

    finals = {}
    for mode in ("sequential", "vmap"):
        torch.manual_seed(0)
        model = LitMLP()
        fedlight.fit(model, _data(), Algorithm(OwnObjective()), loop=_cfg(client_parallelism=mode),
                     precision="64-true", out_dir=str(tmp_path / mode))
        finals[mode] = P.trainable(model)
    for k in finals["sequential"]:
        torch.testing.assert_close(finals["vmap"][k], finals["sequential"][k], rtol=0, atol=1e-10)


def test_one_and_two_processes_agree_for_lightning_code(tmp_path):
    """Client-parallel on 2 gloo processes: the same model and the same test metrics as 1 process (rank 1 gets no
    test batch at all and still takes part in every metric's reduction). The script's 1-process run is made in this
    process (no interpreter start); its 2 processes are real ones."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("mp_lightning.py")
    spec = importlib.util.spec_from_file_location("mp_lightning", script)
    mp_lightning = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp_lightning)
    threads = torch.get_num_threads()
    try:
        mp_lightning.main(1, str(tmp_path / "p1.pt"))
    finally:
        torch.set_num_threads(threads)
    res = subprocess.run([sys.executable, str(script), "2", str(tmp_path / "p2.pt")], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    outs = {n: torch.load(tmp_path / f"p{n}.pt", weights_only=True) for n in (1, 2)}
    assert outs[2]["summary"] == pytest.approx(outs[1]["summary"], abs=1e-6)
    for k, v in outs[1]["model"].items():
        torch.testing.assert_close(outs[2]["model"][k], v, rtol=0, atol=1e-6)


def test_auto_trains_a_lightning_module_sequentially_even_on_cuda_and_says_why():
    from types import SimpleNamespace

    from fedlight import LocalUpdateRule
    from fedlight.runners import SequentialRunner, TrainSetup, select_runner
    from fedlight.tasks import Classification, LightningTask

    fabric = SimpleNamespace(device=torch.device("cuda"), strategy=SimpleNamespace(precision=None))
    setup = dict(model=LitMLP(), local=LocalUpdateRule(), fabric=fabric, optimizer=_cfg().optimizer_factory(),
                 max_grad_norm=None, weight_decay=0.0, seed=0)
    runner, why = select_runner(_cfg(compile=False), TrainSetup(**setup, task=LightningTask()), "fedavg")
    assert isinstance(runner, SequentialRunner) and "LightningModule's training_step logs per client" in why
    runner, _ = select_runner(_cfg(compile=False), TrainSetup(**setup, task=Classification(3)), "fedavg")
    assert not isinstance(runner, SequentialRunner)  # the same module as a plain model under a built-in task
