"""All rules honour the contract on a regression task and on a token (language-model) task: two rounds train, the
communication matches the registry, and stacked clients equal sequential ones in float64."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

import fedlight
from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig
from fedlight.core.registry import get_algorithm
from fedlight.data import MarkovText, TensorClients
from fedlight.engine.driver import FitDriver
from fedlight.engine.loop import FederatedLoop
from fedlight.models import MLP, TinyGPT
from fedlight.tasks import LanguageModeling, Regression

ALGOS = fedlight.list_algorithms()


def _regression():
    g = torch.Generator().manual_seed(0)
    clients = []
    for i in range(4):
        x = torch.randn(12, 5, generator=g) + 0.2 * i
        clients.append((x, x @ torch.linspace(-1, 1, 5) + 0.3 * i))
    torch.manual_seed(0)
    return TensorClients(clients, test=clients[0], batch_size=4), MLP(in_features=5, hidden=[6], num_classes=1), \
        Regression()


def _tokens():
    torch.manual_seed(0)
    return (MarkovText(num_clients=4, vocab_size=5, seq_len=6, sequences_per_client=10, batch_size=4),
            TinyGPT(vocab_size=5, dim=8, layers=1, heads=2, max_len=6), LanguageModeling())


def _loop(name, problem, precision="32-true", mode="sequential"):
    data, model, task = problem()
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    data.input_dtype = torch.float64 if precision == "64-true" else torch.float32
    data.setup(fabric.device, 0)
    cfg = LoopConfig(rounds=2, clients_per_round=3, local_steps=3, lr=0.05, weight_decay=1e-3, max_grad_norm=10.0,
                     progress=False, client_parallelism=mode)
    return FederatedLoop(fabric, model, data, fedlight.create(name), cfg, 0, Path("unused"), task=task)


@pytest.mark.parametrize("problem", [_regression, _tokens], ids=["regression", "tokens"])
@pytest.mark.parametrize("name", ALGOS)
def test_two_rounds_on_any_task(name, problem):
    loop = _loop(name, problem)
    x0 = P.clone(loop.x)
    rows = [loop.run_round(r) for r in range(2)]
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in rows)
    assert float(P.norm(P.sub(loop.x, x0))) > 0, "parameters did not change"
    down, up = get_algorithm(name).comm
    assert rows[-1]["bytes_down"] / (3 * P.nbytes(loop.x)) == pytest.approx(down, abs=0.15)  # + per-tensor scalars
    assert rows[-1]["bytes_up"] / (3 * P.nbytes(loop.x)) == pytest.approx(up, abs=0.15)
    metrics = FitDriver(loop).evaluate()  # the fit driver evaluates the loop's global model
    assert set(metrics) == set(loop.task.metric_names()) and all(map(torch.isfinite, map(torch.tensor,
                                                                                          metrics.values())))


@pytest.mark.parametrize("problem", [_regression, _tokens], ids=["regression", "tokens"])
@pytest.mark.parametrize("name", [n for n in ALGOS if get_algorithm(n).cls().local.stacked_unsupported is None])
def test_stacked_equals_sequential_on_any_task(name, problem):
    finals = {}
    for mode in ("sequential", "vmap"):
        loop = _loop(name, problem, precision="64-true", mode=mode)
        for r in range(2):
            loop.run_round(r)
        finals[mode] = loop.x
    for k in finals["sequential"]:
        torch.testing.assert_close(finals["vmap"][k], finals["sequential"][k], rtol=0, atol=1e-9)
