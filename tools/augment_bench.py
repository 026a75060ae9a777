#!/usr/bin/env python
"""Cost of the 224 px input pipeline (gather, resize, crop/flip, RandAugment, normalise) next to a Swin-T step.

    python tools/augment_bench.py                          # CPU, batch 32, 1 thread
    python tools/augment_bench.py --device cuda --batch 16 --model-steps 20

Batches come from ``CIFAR100.client_batches`` on random uint8 images (the real path: permutation, parameters drawn
from a client generator, one copy to the device, per-batch slicing). The model step is a random-init Swin-T
(``swin_tiny_patch4_window7_224``, 100 classes) forward + backward + ``torch.optim.AdamW`` step on the same batch.
Prints medians in milliseconds and the pipeline / model-step ratio.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def fake_cifar100(root: Path, n: int) -> None:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, size in (("train", n), ("test", 100)):
        data = {"data": rng.integers(0, 256, (size, 3072), dtype=np.uint8), "fine_labels": list(np.arange(size) % 100)}
        with open(folder / name, "wb") as f:
            pickle.dump(data, f)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_batches(data, steps: int, device: torch.device, reps: int) -> float:
    """Median milliseconds per batch of ``client_batches`` (all of one client's ``steps`` batches, materialised)."""
    from fedlight.core.sampling import client_generator

    times = []
    for r in range(reps):
        sync(device)
        t = time.perf_counter()
        for x, _ in data.client_batches(0, steps, client_generator(0, r, 0)):
            x.sum()  # make sure the batch exists
        sync(device)
        times.append((time.perf_counter() - t) * 1e3 / steps)
    return statistics.median(times)


def time_model(batch: int, device: torch.device, reps: int) -> float:
    """Median milliseconds of one Swin-T training step at 224 px."""
    import timm

    model = timm.create_model("swin_tiny_patch4_window7_224", num_classes=100).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    x = torch.randn(batch, 3, 224, 224, device=device)
    y = torch.randint(0, 100, (batch,), device=device)
    times = []
    for _ in range(reps + 1):
        sync(device)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[1:])  # the first step warms up


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="batches per timed client pass")
    p.add_argument("--reps", type=int, default=5, help="timed client passes (median)")
    p.add_argument("--model-steps", type=int, default=2, help="timed Swin-T steps (median; 0 skips the model)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    from fedlight.data import CIFAR100, RandAugment

    with tempfile.TemporaryDirectory() as tmp:
        fake_cifar100(Path(tmp), n=args.batch * args.steps)
        os.environ.setdefault("FEDLIGHT_CACHE", str(Path(tmp) / "cache"))
        settings = {"32 px crop/flip (today)": {}, "224 px resize + crop/flip": {"resize": 224},
                    "224 px resize + crop/flip + RandAugment(2, 9)": {"resize": 224, "randaugment": RandAugment()}}
        rows = []
        for name, kw in settings.items():
            data = CIFAR100(root=tmp, num_clients=1, batch_size=args.batch, **kw)
            data.setup(device, seed=0)
            time_batches(data, 2, device, 1)  # warm-up
            rows.append((name, time_batches(data, args.steps, device, args.reps)))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device {device}, batch {args.batch}, {args.threads} thread(s), torch {torch.__version__}, "
          f"load average {load:.2f} on {os.cpu_count()} CPUs")
    for name, ms in rows:
        print(f"  {name:<48} {ms:9.1f} ms/batch")
    if args.model_steps > 0:
        step = time_model(args.batch, device, args.model_steps)
        print(f"  {'Swin-T 224 px train step (fwd+bwd+AdamW)':<48} {step:9.1f} ms/step")
        print(f"  pipeline / model step: {rows[-1][1] / step:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
