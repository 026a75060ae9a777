"""The loop adds nothing (parity with plain PyTorch), is seeded, resumes bit for bit, and is identical on
1 or 2 processes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fedtest import image_clients, make_loop, tiny_cnn
from torch import nn

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.core.sampling import client_generator, sample_clients
from fedlight.data import TensorClients

CONFIGS = Path(__file__).parent.parent / "configs"


@pytest.mark.parametrize("lr", [0.05, 5.0])  # 5.0: the clip (max norm 1) is active on every step
def test_fedavg_one_client_equals_plain_sgd(lr):
    """FedAvg, 1 client, full participation, η_g = 1 ≡ K steps of a hand-written SGD loop.

    Equal up to the float32 rounding of the server's ``x + (y − x)`` (≤ 1 ulp, vs. ``y`` itself)."""
    torch.manual_seed(0)
    x = torch.randn(20, 5)
    y = torch.randint(0, 3, (20,))
    K, wd, clip = 7, 1e-3, 1.0
    net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    ref = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    ref.load_state_dict(net.state_dict())
    loop = make_loop(fedlight.create("fedavg"), [(x, y)], net, local_steps=K, lr=lr, precision="32-true",
                     weight_decay=wd, max_grad_norm=clip, batch_size=6)
    loop.run_round(0)
    # the same batches the data module yields for (seed 0, round 0, client 0), through plain torch
    data = TensorClients([(x, y)], batch_size=6)
    data.setup("cpu", 0)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, weight_decay=wd)
    for xb, yb in data.client_batches(0, K, client_generator(0, 0, 0)):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(xb), yb).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
    for (k, v), r in zip(loop.x.items(), ref.parameters()):
        torch.testing.assert_close(v, r.detach(), rtol=2**-23, atol=1e-7, msg=k)


def _fit(tmp, name="run", rounds=2, seed=0, **kw):
    data = TensorClients(image_clients(num_clients=5), test=image_clients(1, seed=9)[0], batch_size=4)
    cfg = LoopConfig(rounds=rounds, clients_per_round=3, local_steps=3, lr=0.05, progress=False)
    return fedlight.fit(tiny_cnn(), data, fedlight.create(kw.pop("algorithm", "scaffold")), cfg, seed=seed,
                        out_dir=str(tmp / name), **kw)


def _final(path: Path):
    return torch.load(path / "final_model.pt", weights_only=True)


def test_run_record(tmp_path):
    s = _fit(tmp_path)
    out = tmp_path / "run"
    for f in ("config.yaml", "metrics.jsonl", "summary.json", "final_model.pt", "checkpoints/last.ckpt"):
        assert (out / f).exists(), f
    assert list((out / "tb").glob("events.out.tfevents.*"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for key in ("round", "lr", "train_loss", "round_time_s", "bytes_up", "bytes_down", "test_acc", "test_loss"):
        assert key in rows[-1], key
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary.pop("fedlight_sha256")) == 64  # summary.json: the returned summary and its digest
    assert summary == json.loads(json.dumps(s))
    for key in ("final_test_acc", "best_test_acc", "best_round", "rounds_completed", "rounds_to_target",
                "wall_time_s", "seconds_per_round", "bytes_up", "bytes_down", "versions"):
        assert key in summary, key
    assert summary["bytes_up"] == sum(r["bytes_up"] for r in rows)
    assert summary["final_test_acc"] == rows[-1]["test_acc"]
    state = _final(out)
    assert "net.1.running_mean" in state  # BatchNorm statistics travel with the model


def test_seeds(tmp_path):
    a, b, c = _final_of(tmp_path, "a", 0), _final_of(tmp_path, "b", 0), _final_of(tmp_path, "c", 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert sample_clients(100, 10, 0, 3) == sample_clients(100, 10, 0, 3)
    assert sample_clients(100, 10, 0, 3) != sample_clients(100, 10, 1, 3)
    assert sample_clients(100, 10, 0, 3) != sample_clients(100, 10, 0, 4)


def _final_of(tmp, name, seed):
    _fit(tmp, name, seed=seed)
    return _final(tmp / name)


def test_resume_is_bitwise(tmp_path):
    _fit(tmp_path, "full", rounds=4)
    _fit(tmp_path, "split", rounds=2)
    _fit(tmp_path, "split", rounds=4, resume="auto")
    full, split = _final(tmp_path / "full"), _final(tmp_path / "split")
    for k in full:
        assert torch.equal(full[k], split[k]), k
    rows = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in rows] == [1, 2, 3, 4]
    a = [json.loads(r)["train_loss"] for r in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(r)["train_loss"] for r in rows]
    assert a == b


def test_existing_run_dir_is_not_overwritten(tmp_path):
    from fedlight.errors import ConfigError

    _fit(tmp_path, "r")
    with pytest.raises(ConfigError, match="already holds a run"):
        _fit(tmp_path, "r")
    _fit(tmp_path, "r", overwrite=True)


def test_one_vs_two_processes_cli(tmp_path, monkeypatch):
    """The real CLI with `--devices 2` (Fabric ddp launcher, gloo): same global model as 1 process (the same
    command with `--devices 1`, run in this process: no interpreter start)."""
    from fedlight.config.cli import main

    def args(n):
        return ["fit", "--config", str(CONFIGS / "tiny.yaml"), "--devices", str(n), "--accelerator", "cpu",
                "--out_dir", str(tmp_path / f"d{n}")]

    res = subprocess.run([sys.executable, "-m", "fedlight.config.cli", *args(2)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what the CLI sets for a CPU run (here: not left behind)
    assert main(args(1)) == 0
    finals = {n: _final(tmp_path / f"d{n}") for n in (1, 2)}
    for k in finals[1]:
        torch.testing.assert_close(finals[2][k], finals[1][k], rtol=0, atol=1e-6)


def test_fashion_mnist_learns(tmp_path):
    """Real data: 3 rounds of FedAvg on a small Fashion-MNIST subset from ../shared/data beat chance by far."""
    from fedlight.data import Dirichlet, FashionMNIST
    from fedlight.models import MLP

    data = FashionMNIST(num_clients=10, batch_size=50, subset=3000, test_subset=1000,
                        partition=Dirichlet(alpha=0.5))
    cfg = LoopConfig(rounds=3, clients_per_round=5, local_epochs=3, lr=0.1, progress=False)
    s = fedlight.fit(MLP(), data, fedlight.create("fedavg"), cfg, out_dir=str(tmp_path / "fm"))
    assert s["final_test_acc"] > 0.5, s  # chance is 0.1
    assert np.isfinite(s["final_test_loss"])
