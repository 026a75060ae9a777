#!/usr/bin/env python
"""The CUDA paths that had never run on a GPU, each run once (a step of ``tools/gpu_check.sh``; issue 31).

    python tools/gpu_paths.py                    # on a CUDA machine
    python tools/gpu_paths.py --smoke            # CPU, tiny sizes: the same code, numbers meaningless

Steps (``--steps``, comma-separated; each prints ``paths: <step> ...`` lines as it goes, a failing step prints
``paths: <step>: FAILED ...`` and the others still run):

* ``dtypes``: the dtype a convolution computes in under bf16 autocast — one client's plain convolution, vmap's
  grouped one (the stacked runner's), the channels-last route's — eager and compiled (on CPU, torch 2.x, vmap's
  batched convolution is not autocast: it stays float32).
* ``lightning``: a LightningModule (a small convnet with its own ``training_step`` and ``configure_optimizers``)
  under FedAvg and FedSAM, the sequential runner and the stacked one (compiled on CUDA), through ``fedlight.fit``:
  runner, s/round, final loss, and the stacked model's largest difference from the sequential one.
* ``swin``: Swin-T at 224 px (random init, DropPath 0.2) on CIFAR-100-shaped random images resized and
  RandAugmented on the device, FedAdamW, one round: runner and s/step.
* ``chunk``: ``loop.vmap_chunk: auto`` on ResNet-18 (GroupNorm), eager stacked: the chunk chosen, the driver's
  free-memory count behind it, out-of-memory fallbacks (none expected), s/round.
* ``compile_fail``: the stacked step compiled with torch's test backend that refuses any graph with a ReLU: the
  fallback line and the runner that trained.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = ("dtypes", "lightning", "swin", "chunk", "compile_fail")


def _lit_module(channels: int):
    import lightning.pytorch as pl
    import torch.nn.functional as F

    class LitConv(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.GroupNorm(4, channels), nn.ReLU(),
                                     nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_ce", loss)
            return loss

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_acc", (self(x).argmax(-1) == y).float().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)
    return LitConv()


def _fit(model, data, algorithm, loop, precision, accelerator) -> tuple[dict, list[dict], Path]:
    import fedlight

    out = Path(tempfile.mkdtemp(prefix="gpu-paths-"))
    fedlight.fit(model, data, algorithm, loop=loop, seed=0, out_dir=str(out / "run"), accelerator=accelerator,
                 precision=precision)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "run" / "summary.json").read_text()), rows, out / "run"


def _s_per_round(rows: list[dict]) -> float:
    warm = [r["round_time_s"] for r in rows if not r.get("warm_up")] or [r["round_time_s"] for r in rows]
    return sum(warm) / len(warm)


def dtypes(smoke: bool, acc: str, precision: str) -> None:
    import torch.nn.functional as F
    from torch.func import vmap

    from fedlight.runners.nhwc import stacked_conv2d

    dev = torch.device(acc)
    x, w = torch.randn(2, 4, 8, 16, 16, device=dev), torch.randn(2, 8, 8, 3, 3, device=dev)
    fns = {"one client's conv2d": lambda: F.conv2d(x[0], w[0], padding=1),
           "vmap's grouped conv (stacked)": lambda: vmap(lambda a, b: F.conv2d(a, b, padding=1))(x, w),
           "channels-last route": lambda: vmap(
               lambda a, b: stacked_conv2d(a, b, None, [1, 1], [1, 1], [1, 1], 1))(x, w)}
    backend = "aot_eager" if smoke else "inductor"
    for name, fn in fns.items():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            eager, compiled = fn().dtype, torch.compile(fn, backend=backend)().dtype
        print(f"paths: dtypes: {name} under bf16 autocast on {dev.type}: eager {eager}, compiled ({backend}) "
              f"{compiled}", flush=True)


def lightning(smoke: bool, acc: str, precision: str) -> None:
    import fedlight
    from fedlight.core.loop_config import LoopConfig
    from fedlight.data import TensorClients

    n, size = (8, 8) if smoke else (200, 32)
    g = torch.Generator().manual_seed(0)
    clients = [(torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(4)]
    for algo in ("fedavg", "fedsam"):
        finals = {}
        for mode in ("sequential", "vmap"):
            loop = LoopConfig(rounds=1 if smoke else 3, clients_per_round=4, local_steps=2 if smoke else 10,
                              progress=False, client_parallelism=mode, compile=mode == "vmap" and not smoke)
            data = TensorClients(clients, batch_size=4 if smoke else 20, num_classes=10)
            summary, rows, run = _fit(_lit_module(4 if smoke else 64), data, fedlight.create(algo), loop, precision,
                                      acc)
            finals[mode] = torch.load(run / "final_model.pt", weights_only=True)
            print(f"paths: lightning {algo} {mode}: runner {summary['client_runner']}, {_s_per_round(rows):.3f} "
                  f"s/round, train loss {rows[-1]['train_loss']:.4f}", flush=True)
        diff = max(float((finals["vmap"][k].float() - v.float()).abs().max()) for k, v in finals["sequential"].items())
        print(f"paths: lightning {algo}: stacked vs sequential final model, max |diff| {diff:.2e} ({precision})",
              flush=True)


def swin(smoke: bool, acc: str, precision: str) -> None:
    from augment_bench import fake_cifar100

    import fedlight
    from fedlight import models
    from fedlight.core.loop_config import LoopConfig
    from fedlight.data import CIFAR100, Dirichlet, RandAugment

    root = Path(tempfile.mkdtemp(prefix="gpu-paths-cifar-"))
    fake_cifar100(root, 200)
    px, batch, steps = (64, 4, 2) if smoke else (224, 16, 5)
    kwargs = {"drop_path_rate": 0.2}
    if smoke:
        kwargs.update(patch_size=8, window_size=4, depths=(1, 1), num_heads=(1, 2), embed_dim=16)
    torch.manual_seed(0)
    model = models.Timm("swin_tiny_patch4_window7_224", num_classes=100, img_size=px, kwargs=kwargs)
    data = CIFAR100(root=str(root), num_clients=4, batch_size=batch, partition=Dirichlet(100.0), resize=px,
                    randaugment=RandAugment(), eval_batch_size=50)
    algo = fedlight.algorithms.FedAdamW(blocks="hessian", head_dim=16 if smoke else 32)
    loop = LoopConfig(rounds=1, clients_per_round=2, local_steps=steps, lr=1e-4, local_lr_schedule="cosine",
                      progress=False)
    summary, rows, _ = _fit(model, data, algo, loop, precision, acc)
    s = rows[0]["round_time_s"]
    print(f"paths: swin {px} px + RandAugment on {acc}: runner {summary['client_runner']}, one round {s:.2f} s "
          f"(compiling or first-touch included), {s / (2 * steps):.3f} s/step, train loss {rows[0]['train_loss']:.3f}",
          flush=True)


def chunk(smoke: bool, acc: str, precision: str) -> None:
    from fedlight.lab.benchmarks.workload import Workload, fedlight_loop

    w = Workload("lenet5" if smoke else "resnet18", clients=3 if smoke else 10, steps=2 if smoke else 50,
                 batch=4 if smoke else 50)
    loop = fedlight_loop(w.model(), w.data(), w, acc, precision, parallelism="vmap", compile=False, vmap_chunk="auto")
    t = time.perf_counter()
    loop.run_round(0)
    loop.run_round(1)
    print(f"paths: chunk: vmap_chunk auto chose {loop.runner.chunk} of {w.clients} clients per chunk; fallbacks "
          f"{loop.runner.fallbacks or 'none'}; {(time.perf_counter() - t) / 2:.3f} s/round over 2 rounds", flush=True)


def compile_fail(smoke: bool, acc: str, precision: str) -> None:
    from fedlight.lab.benchmarks.workload import Workload, fedlight_loop

    class ReluNet(nn.Module):  # torch.relu: what the failing test backend looks for
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3 * 32 * 32, 16), nn.Linear(16, 10)

        def forward(self, x):
            return self.b(torch.relu(self.a(x.flatten(1))))

    w = Workload("lenet5", clients=2, steps=2, batch=4)
    torch.manual_seed(0)
    loop = fedlight_loop(ReluNet(), w.data(), w, acc, precision, parallelism="vmap",
                         compile="relu_compile_error_TESTING_ONLY")
    loop.run_round(0)
    if not loop.runner.fallbacks:
        raise RuntimeError(f"the failing backend did not fall back: trained by {loop.runner.description}")
    print(f"paths: compile_fail: trained by {loop.runner.description}; fallback: {loop.runner.fallbacks[0][:160]}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks the code, numbers meaningless")
    p.add_argument("--steps", default=",".join(STEPS))
    a = p.parse_args(argv)
    acc, precision = ("cpu", "32-true") if a.smoke else ("cuda", "bf16-mixed")
    failed = 0
    for step in a.steps.split(","):
        t = time.perf_counter()
        try:
            run = {"dtypes": dtypes, "lightning": lightning, "swin": swin, "chunk": chunk,
                   "compile_fail": compile_fail}[step]
            run(a.smoke, acc, precision)
        except Exception as e:  # noqa: BLE001 - one failing path must not hide the others
            failed += 1
            print(f"paths: {step}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                  flush=True)
        print(f"[{step}: {time.perf_counter() - t:.0f} s]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
