"""Run every registered rule for 2 rounds on N CPU processes (Fabric ddp, gloo); rank 0 saves the results.

Usage: python mp_contract.py N OUT.pt [PARALLELISM [NAME ...]]   (the subprocess launcher re-runs this script for
ranks ≥ 1; PARALLELISM is loop.client_parallelism, default sequential; NAMEs restrict the rules: registry names,
or ``module:Class`` of a test rule importable from tests/)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from fedtest import image_clients, tiny_cnn  # noqa: E402

import fedlight  # noqa: E402
from fedlight.core.loop_config import LoopConfig  # noqa: E402
from fedlight.data import TensorClients  # noqa: E402
from fedlight.engine.loop import FederatedLoop  # noqa: E402


def create(name: str):
    if ":" not in name:
        return fedlight.create(name)
    import importlib

    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)()


def main(n: int, out: str, parallelism: str = "sequential", *names: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=n, strategy="ddp" if n > 1 else "auto", precision="32-true")
    fabric.launch()
    torch.set_num_threads(1)
    results = {}
    for name in names or fedlight.list_algorithms():
        data = TensorClients(image_clients(), batch_size=4)
        data.setup(fabric.device, 0)
        cfg = LoopConfig(rounds=2, clients_per_round=3, local_steps=3, lr=0.05, progress=False,
                         client_parallelism=parallelism)
        loop = FederatedLoop(fabric, tiny_cnn(), data, create(name), cfg, 0, Path("unused"), data.default_task())
        for r in range(2):
            loop.run_round(r)
        results[name] = {**{f"x.{k}": v.cpu() for k, v in loop.x.items()},
                         **{f"b.{k}": v.cpu() for k, v in loop.buffers.items()}}
    if fabric.global_rank == 0:
        torch.save(results, out)
    if fabric.world_size > 1:  # leave the group together: gloo's threads must not meet the interpreter's exit
        fabric.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), *sys.argv[2:])
