"""A LightningModule (an lr schedule by step, epoch-end hooks) + LightningDataModule through ``fedlight.fit`` on N
CPU processes; rank 0 saves the outcome (final model, test metrics, epoch-end logs).

Usage: python mp_lightning.py N OUT.pt   (Fabric's launcher re-runs this script for ranks >= 1)
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from lit import BlobsDataModule, Scheduled  # noqa: E402

import fedlight  # noqa: E402
from fedlight.core.loop_config import LoopConfig  # noqa: E402
from fedlight.data import DataModuleClients, Dirichlet  # noqa: E402


class OneTestBatch(BlobsDataModule):
    """The test set in a single batch: with 2 processes, rank 1 evaluates nothing and must still reduce."""

    def test_dataloader(self):
        return torch.utils.data.DataLoader(self.test, batch_size=len(self.test), collate_fn=self.collate)


def main(n: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = DataModuleClients(OneTestBatch(), num_clients=6, partition=Dirichlet(0.5))
    summary = fedlight.fit(Scheduled("step"), data, fedlight.create("scaffold"), accelerator="cpu", devices=n,
                           loop=LoopConfig(rounds=2, clients_per_round=4, local_steps=3, progress=False),
                           out_dir=str(Path(out).with_suffix("")), overwrite=True)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # rank 0 holds the run record (other ranks' summaries are empty)
        final = torch.load(Path(out).with_suffix("") / "final_model.pt", weights_only=True)
        torch.save({"summary": {k: v for k, v in summary.items() if k.startswith("final_")}, "model": final}, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
