"""Data without a test set: nothing is evaluated, said once at the start; no NaN loss, no 0 % accuracy, no warning
blaming the learning rate, and the summary's test metrics are absent (``null``)."""

import json

import torch

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.data import TensorClients
from fedlight.models import MLP


def _clients():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (12, 9, 15)]


def test_a_run_without_a_test_set_evaluates_nothing_and_says_so(tmp_path, capfd):
    loop = LoopConfig(rounds=2, clients_per_round=2, local_steps=2, lr=0.05, progress=False)
    summary = fedlight.fit(MLP(in_features=10, hidden=[8], num_classes=3), TensorClients(_clients(), batch_size=4),
                           fedlight.create("fedavg"), loop, seed=0, out_dir=str(tmp_path / "run"), accelerator="cpu",
                           loggers=None)
    err = "".join(capfd.readouterr())  # stdout and stderr
    assert "the data has no test set: nothing is evaluated" in err
    assert "not finite" not in err and "called before the ``update``" not in err, err
    assert summary["final_test_acc"] is None and summary["best_test_acc"] is None
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and not any(k.startswith("test_") for r in rows for k in r)
