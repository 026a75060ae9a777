"""Test helpers: a tiny softmax-regression problem, a loop without files, a numpy reference, a script loaded from
its file, and imports restored after a test that registers rules of its own."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from fedlight.core.loop_config import LoopConfig
from fedlight.data import TensorClients
from fedlight.engine.driver import FitDriver
from fedlight.engine.loop import FederatedLoop
from fedlight.run.files import load_checkpoint
from fedlight.run.record import RunRecord

D, C = 3, 3  # features, classes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
"""The ``device`` parameter of a test that needs CUDA: the same body runs on CPU in CI, so a changed signature or a
removed helper fails there too; only the CUDA value is skipped without a GPU (``tests/test_gpu_tools.py`` fails on
a test skipped without CUDA as a whole)."""


def problem(num_clients: int = 3, n: int = 4, seed: int = 0):
    """Client data exactly representable in float32 (multiples of 1/4), and an initial (W, b)."""
    rng = np.random.default_rng(seed)
    clients = []
    for _ in range(num_clients):
        x = rng.integers(-4, 5, size=(n, D)) / 4.0
        y = rng.integers(0, C, size=n)
        clients.append((x, y))
    W0 = rng.integers(-4, 5, size=(C, D)) / 8.0
    b0 = rng.integers(-4, 5, size=C) / 8.0
    return clients, {"weight": W0, "bias": b0}


def linear_model(theta0: dict[str, np.ndarray]) -> nn.Module:
    m = nn.Linear(D, C)
    with torch.no_grad():
        m.weight.copy_(torch.tensor(theta0["weight"]))
        m.bias.copy_(torch.tensor(theta0["bias"]))
    return m


def make_loop(algorithm, clients, model: nn.Module, *, rounds: int = 2, local_steps: int = 2, lr: float = 0.1,
              clients_per_round: int | None = None, precision: str = "64-true", weight_decay: float = 0.0,
              max_grad_norm: float | None = None, seed: int = 0, batch_size: int | None = None,
              out_dir: str | Path = "unused", accelerator: str = "cpu", **loop_kwargs) -> FederatedLoop:
    """A FederatedLoop on ``accelerator`` (CPU) over ``clients`` (numpy or torch pairs); full-batch by default."""
    pairs = [(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long)) for x, y in clients]
    B = batch_size or max(len(y) for _, y in pairs)
    data = TensorClients(pairs, test=pairs[0], batch_size=B, num_classes=C if model.__class__ is nn.Linear else None)
    fabric = L.Fabric(accelerator=accelerator, devices=1, precision=precision)
    data.setup(fabric.device, seed)
    cfg = LoopConfig(rounds=rounds, clients_per_round=clients_per_round or len(pairs), local_steps=local_steps,
                     lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm, progress=False, **loop_kwargs)
    return FederatedLoop(fabric, model, data, algorithm, cfg, seed, Path(out_dir), data.default_task())


def save_checkpoint(loop: FederatedLoop, out_dir: str | Path) -> Path:
    """Checkpoint ``loop``'s state the way a run does (the run record's background writer); returns the path."""
    record = RunRecord(out_dir, progress=False)
    record.open(None, tensorboard=False, fresh=False)
    try:
        record.round_done({"round": loop.state.rounds_done}, loop.state.snapshot())
    finally:
        record.close()
    return Path(out_dir) / "checkpoints" / "last.ckpt"


def resume(loop: FederatedLoop, path: str | Path) -> None:
    """Continue ``loop`` from the checkpoint at ``path`` the way a run does (checked, then restored)."""
    FitDriver(loop).resume(load_checkpoint(Path(path)), path)


def run_rounds(loop: FederatedLoop, rounds: int) -> dict[str, np.ndarray]:
    rows = [loop.run_round(r) for r in range(rounds)]
    loop.rows = rows
    return {k: v.detach().cpu().double().numpy() for k, v in loop.x.items()}


# ---------------------------------------------------------------- numpy reference (the derivations use these)
def grad(theta: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """∇ of mean cross-entropy of softmax(x Wᵀ + b) at θ = (W, b)."""
    z = x @ theta["weight"].T + theta["bias"]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return {"weight": p.T @ x, "bias": p.sum(0)}


def loss(theta, x, y) -> float:
    z = x @ theta["weight"].T + theta["bias"]
    z = z - z.max(1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(y)), y]))


def lin(*terms):
    """Σ s·θ over (s, θ) pairs of dicts."""
    out = {k: np.zeros_like(v) for k, v in terms[0][1].items()}
    for s, t in terms:
        for k in out:
            out[k] = out[k] + s * t[k]
    return out


def norm(t) -> float:
    return float(np.sqrt(sum(np.sum(v * v) for v in t.values())))


def assert_params_close(got: dict, want: dict, tol: float = 1e-10) -> None:
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=tol, err_msg=k)


# ---------------------------------------------------------------- a tiny image problem with BatchNorm
def image_clients(num_clients: int = 4, n: int = 12, classes: int = 3, size: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_clients):
        y = torch.randint(0, classes, (n,), generator=g)
        x = torch.randn(n, 1, size, size, generator=g) + y.view(-1, 1, 1, 1) * 0.5 + 0.1 * i
        out.append((x, y))
    return out


def tiny_cnn(seed: int = 0):
    from fedlight.models import SmallCNN

    torch.manual_seed(seed)
    return SmallCNN(in_channels=1, num_classes=3, width=4, norm="batch")


def contract_loop(name: str, rounds: int = 2, out_dir="unused", model: nn.Module | None = None, **kw) -> FederatedLoop:
    """The contract setting: 4 clients, 3 per round, minibatch 4, K = 3, 32-true, defaults of the rule."""
    import fedlight

    args = dict(local_steps=3, lr=0.05, clients_per_round=3, precision="32-true", weight_decay=1e-3,
                max_grad_norm=10.0, batch_size=4, rounds=rounds, out_dir=out_dir)
    args.update(kw)
    return make_loop(fedlight.create(name), image_clients(), model if model is not None else tiny_cnn(), **args)


def zeros(theta):
    return {k: np.zeros_like(v) for k, v in theta.items()}


def mean(ds):
    """Plain mean of parameter dicts."""
    return lin(*[(1 / len(ds), d) for d in ds])


def sub(a, b):
    return lin((1, a), (-1, b))


def emap(f, *ts):
    """Element-wise ``f`` over dicts with the same keys."""
    return {k: f(*(t[k] for t in ts)) for k in ts[0]}


def as_np(p):
    return {k: v.detach().cpu().double().numpy() for k, v in p.items()}


class Clip:
    """The loop's joint clip: coef = c/(‖g‖ + 1e-6), at most 1; counts the steps where it was active."""

    def __init__(self, c):
        self.c, self.active = c, 0

    def __call__(self, g):
        if self.c is None:
            return g
        coef = min(1.0, self.c / (norm(g) + 1e-6))
        self.active += coef < 1.0
        return lin((coef, g))


def spy_auto_chunk(monkeypatch, chunk: int) -> list[tuple]:
    """Make ``vmap_chunk: auto`` find room for exactly ``chunk`` clients of the footprint it measures; returns the
    list that receives each measurement ``(batch, objective, bytes)``."""
    import fedlight.runners.stacked as stacked
    from fedlight.runners import guard

    seen: list[tuple] = []

    def footprint(model, batch, objective, state_bytes=0):
        seen.append((batch, objective, guard.client_footprint(model, batch, objective, state_bytes)))
        return seen[-1][2]

    monkeypatch.setattr(stacked, "client_footprint", footprint)
    monkeypatch.setattr(stacked, "free_bytes", lambda device: int((chunk + 0.5) * seen[-1][2] / guard.HEADROOM))
    return seen


def waited_on_probes_only(seen: dict) -> bool:
    """The ``network_waits`` fixture (conftest.py) saw the reachability probes (at most two) and at most one other
    connection (a library's single request, refused at once): no retry, and no back-off sleep."""
    return seen["probes"] <= 2 and seen["connections"] <= seen["probes"] + 1 and seen["slept_s"] < 1.0


def load_script(path: Path):
    """The module of a script that is not in a package (``tools/*.py``, ``docs/_ext/*.py``), imported from its
    file under its stem's name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def imports_restored(folder: Path):
    """On exit, the algorithm registry (saved with fedlight's own rules registered) and ``sys.path`` as they were on
    entry, and the modules imported from files under ``folder`` forgotten: a test may import and register rules of a
    folder of its own."""
    import fedlight.algorithms  # noqa: F401 - fedlight's own rules registered before the registry is saved
    from fedlight.core import registry

    saved_registry, saved_path, before = dict(registry._REGISTRY), list(sys.path), set(sys.modules)
    try:
        yield
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved_registry)
        sys.path[:] = saved_path
        for name in set(sys.modules) - before:
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(folder)):
                del sys.modules[name]
