"""A rule in your own Fabric script (fedlight.fabric.ClientTrainer) trains every registered rule exactly as
`fedlight fit` does, and docs/fabric.md's snippet runs for every registered rule."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

import fedlight
from fedlight import RoundInfo
from fedlight.core.loop_config import LoopConfig
from fedlight.core.params import float_buffers
from fedlight.core.rules import cross_entropy
from fedlight.core.sampling import client_generator, round_clients
from fedlight.data import TensorClients
from fedlight.fabric import ClientTrainer

RULES = fedlight.list_algorithms()
N, S, K, ROUNDS, SEED = 4, 3, 2, 2, 0  # clients, sampled per round, local steps, rounds
DOC = Path(__file__).resolve().parent.parent / "docs" / "fabric.md"


def test_every_rule_is_covered():
    assert len(RULES) >= 28  # the registry, not a hand-kept list


def _model() -> nn.Module:
    torch.manual_seed(SEED)  # BatchNorm: the helper must carry and average its statistics like the loop
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _data() -> TensorClients:
    g = torch.Generator().manual_seed(1)
    sizes = [6, 9, 7, 8]  # unequal n_i: sample weighting matters
    return TensorClients([(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes],
                         batch_size=4, num_classes=3)


def _own_loop(algo, cfg: LoopConfig) -> tuple[ClientTrainer, dict]:
    """The docs' loop with fedlight.fabric.ClientTrainer, fed fit's batches and sampling (64-true)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="64-true")
    data = _data()
    data.input_dtype = torch.float64  # as fit has it for 64-true
    data.setup(fabric.device, SEED)
    trainer = ClientTrainer(fabric, _model(), algo, cross_entropy, loop=cfg, seed=SEED)
    x = trainer.x0  # the server rule is set up for it
    for r in range(ROUNDS):
        info = RoundInfo(round=r, lr=cfg.lr_schedule.lr(cfg.lr, r, ROUNDS), num_steps=K, num_clients=N,
                         sampled=round_clients(N, S, SEED, r))
        results = [trainer.train(c, algo.server.broadcast(x, info, c),
                                 list(data.client_batches(c, K, client_generator(SEED, r, c))), info,
                                 num_samples=data.num_samples(c)) for c in info.sampled]
        x = algo.server.update(x, trainer.aggregate(results), info)
    return trainer, x


def _assert_equal(mine: dict, theirs: dict, what: str) -> None:
    assert mine.keys() == theirs.keys()
    for k, v in theirs.items():
        assert v.dtype == mine[k].dtype, k
        if v.is_floating_point():
            assert float((mine[k] - v).abs().max()) <= 1e-12, (what, k)
        else:
            assert torch.equal(mine[k], v), (what, k)  # num_batches_tracked advanced the loop's way


@pytest.mark.parametrize("name", RULES)
def test_own_fabric_loop_equals_fedlight_fit(name, tmp_path):
    """fit's global model (parameters, BatchNorm statistics and counters) to 1e-12 in float64 after 2 rounds of 3 of 4
    clients, for every registered rule."""
    cfg = LoopConfig(rounds=ROUNDS, clients_per_round=S, local_steps=K, progress=False).for_rule(fedlight.create(name))
    fitted = _model()
    fedlight.fit(fitted, _data(), fedlight.create(name), cfg, seed=SEED, out_dir=str(tmp_path), accelerator="cpu",
                 precision="64-true", loggers=None)
    trainer, x = _own_loop(fedlight.create(name), cfg)
    assert trainer.train_loss > 0
    _assert_equal(trainer.load(x).state_dict(), fitted.state_dict(), name)
    assert any(float((x[k] - trainer.x0[k]).abs().max()) > 1e-6 for k in x), "the rule did not train"
    initial = float_buffers(_model().double())
    assert any(float((trainer.buffers[k] - v).abs().max()) > 1e-6 for k, v in initial.items()), "BatchNorm unmoved"


def test_a_private_rule_gets_its_noise_at_aggregation(tmp_path):
    """fedlight.privacy's central noise is added in the aggregation, as in fit (same seed: the same noise)."""
    from fedlight.privacy.settings import PrivacyConfig
    from fedlight.privacy.wrap import private

    cfg = LoopConfig(rounds=ROUNDS, clients_per_round=S, local_steps=K, lr=0.1, aggregate_buffers=False,
                     progress=False)  # BatchNorm statistics would bypass the noise: fit refuses them under privacy
    dp = PrivacyConfig(noise_multiplier=1.0, clip=0.5)
    fitted = _model()
    fedlight.fit(fitted, _data(), fedlight.create("fedavg"), cfg, seed=SEED, out_dir=str(tmp_path),
                 accelerator="cpu", precision="64-true", loggers=None, privacy=dp)
    trainer, x = _own_loop(private(fedlight.create("fedavg"), dp, SEED, N, S, ROUNDS), cfg)
    _assert_equal(trainer.load(x).state_dict(), fitted.state_dict(), "private fedavg")
    plain, x_plain = _own_loop(fedlight.create("fedavg"), cfg)
    assert max(float((x[k] - x_plain[k]).abs().max()) for k in x) > 1e-3  # the noise is there


def _snippet() -> str:
    return re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)


@pytest.mark.parametrize("name", RULES)
def test_docs_snippet_runs_for_every_rule(name, capsys):
    """docs/fabric.md's first block (the README's too), its rule swapped for each registered one: it trains and prints
    a loss a round."""
    code = _snippet()
    assert code.count('create("fedwmsam")') == 1, "the snippet names its rule once, in create(...)"
    scope: dict = {"__name__": "__main__"}
    exec(compile(code.replace('create("fedwmsam")', f'create("{name}")'), "docs/fabric.md", "exec"), scope)
    x = scope["x"]
    assert all(torch.isfinite(v).all() for v in x.values())
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("round ")]
    assert len(lines) == 3 and all(float(ln.rsplit(" ", 1)[1]) > 0 for ln in lines), lines
    if name == "fedwmsam":  # the output the page shows is this block's
        shown = re.search(r"```text\n(.*?)```", DOC.read_text(), re.S).group(1).splitlines()
        split = [ln.rsplit(" ", 1) for ln in shown], [ln.rsplit(" ", 1) for ln in lines]
        assert [a for a, _ in split[0]] == [a for a, _ in split[1]]
        assert [float(v) for _, v in split[0]] == pytest.approx([float(v) for _, v in split[1]], abs=2e-4)


def test_aggregate_takes_this_rounds_results_once():
    algo = fedlight.create("fedavg")
    trainer = ClientTrainer(None, _model(), algo, cross_entropy)
    x = trainer.x0
    info = RoundInfo(round=0, lr=0.1, num_steps=1, num_clients=1, sampled=[0])
    batch = (torch.randn(4, 5), torch.tensor([0, 1, 2, 0]))
    res = trainer.train(0, algo.server.broadcast(x, info, 0), [batch], info)
    assert res.num_samples == 4  # counted from the batches
    trainer.aggregate([res])
    with pytest.raises(ValueError, match="each once"):
        trainer.aggregate([res])
    with pytest.raises(ValueError, match="at least one"):
        trainer.aggregate([])
