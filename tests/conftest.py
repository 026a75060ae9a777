import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from slurm_cluster import slurm_cluster  # noqa: E402, F401 - the real single-node Slurm fixture

if "FEDLIGHT_DATA" not in os.environ and (ROOT.parent / "shared" / "data").exists():
    os.environ["FEDLIGHT_DATA"] = str(ROOT.parent / "shared" / "data")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """Decoded-dataset cache shared by the session, never the user's ~/.cache."""
    if "FEDLIGHT_CACHE" not in os.environ:
        monkeypatch.setenv("FEDLIGHT_CACHE", str(tmp_path_factory.getbasetemp() / "fedlight-cache"))


def pytest_configure(config):
    # Tiny tensors: thread fan-out costs more than it saves, and CI has 2 cores.
    import torch

    torch.set_num_threads(1)
