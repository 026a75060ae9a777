"""What :mod:`fedlight.lab.benchmarks.cpu`, :mod:`~fedlight.lab.benchmarks.gpu` and :mod:`~fedlight.lab.benchmarks.nlp`
share: the workload, a real loop on it, a timer that waits for the device, and the process's memory."""

from __future__ import annotations

import os
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass
class Workload:
    """One benchmark setting: ``clients`` clients, each ``steps`` local steps of batch ``batch`` per round."""

    name: str = "mlp"
    clients: int = 10
    steps: int = 50
    batch: int = 50
    lr: float = 0.05
    weight_decay: float = 1e-3
    max_grad_norm: float | None = 10.0
    seed: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return {"mlp": (1, 28, 28), "lenet5": (3, 32, 32), "resnet18": (3, 32, 32)}[self.name]

    @property
    def num_classes(self) -> int:
        return 100 if self.name == "resnet18" else 10

    def model(self) -> nn.Module:
        from fedlight.models import MLP, LeNet5, ResNet18

        torch.manual_seed(self.seed)
        if self.name == "mlp":
            return MLP(784, (200, 200), 10)
        if self.name == "lenet5":
            return LeNet5(3, 10, 32)
        return ResNet18(num_classes=100)

    def data(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Random inputs of the dataset's shape; each client holds exactly one epoch (steps × batch samples)."""
        g = torch.Generator().manual_seed(self.seed + 1)
        n = self.steps * self.batch
        return [(torch.randn(n, *self.shape, generator=g), torch.randint(0, self.num_classes, (n,), generator=g))
                for _ in range(self.clients)]


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    """Peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(who).ru_maxrss / 1024


def rss_now_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fedlight_loop(model: nn.Module, clients, w: Workload, accelerator: str = "cpu", precision: str = "32-true",
                  algorithm: str = "fedavg", out_dir: str | None = None, data=None, parallelism: str = "sequential",
                  task=None, **loop_kwargs):
    """A real :class:`FederatedLoop` (FedAvg by default) on ``TensorClients`` holding the same tensors (or on
    ``data``, trained for ``task``; default the data's own, ``data.default_task()``)."""
    import lightning as L

    import fedlight
    from fedlight.core.loop_config import LoopConfig
    from fedlight.data import TensorClients
    from fedlight.engine.loop import FederatedLoop

    fabric = L.Fabric(accelerator=accelerator, devices=1, precision=precision)
    if data is None:
        data = TensorClients(clients, batch_size=w.batch, num_classes=w.num_classes)
    data.setup(fabric.device, w.seed)
    cfg = LoopConfig(rounds=10**6, clients_per_round=w.clients, local_steps=w.steps, lr=w.lr,
                     weight_decay=w.weight_decay, max_grad_norm=w.max_grad_norm, progress=False,
                     client_parallelism=parallelism, **loop_kwargs)
    out = Path(out_dir or tempfile.mkdtemp(prefix="fedlight-bench-"))
    task = task if task is not None else data.default_task()
    return FederatedLoop(fabric, model, data, fedlight.create(algorithm), cfg, w.seed, out, task)


def timed(fn, device: torch.device) -> tuple[float, float]:
    _sync(device)
    t, c = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - t, time.process_time() - c
