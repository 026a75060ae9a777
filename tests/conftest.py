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


@pytest.fixture
def network_waits(monkeypatch):
    """What this process waits on the network for: every TCP connection it tries, the Hub reachability probes
    (:func:`fedlight.models.hub.reachable`) and the seconds it asks ``time.sleep`` for. "Fails fast without the
    network" is checked on these, not on a clock a loaded machine slows: no retry, no back-off
    (``fedtest.waited_on_probes_only``)."""
    import socket
    import time

    from fedlight.models import hub

    seen = {"connections": 0, "probes": 0, "slept_s": 0.0}
    connect, reachable, sleep = socket.socket.connect, hub.reachable, time.sleep

    def counted_connect(self, address):
        seen["connections"] += 1
        return connect(self, address)

    def counted_reachable(*args, **kwargs):
        seen["probes"] += 1
        return reachable(*args, **kwargs)

    def counted_sleep(seconds):
        seen["slept_s"] += seconds
        return sleep(seconds)

    monkeypatch.setattr(socket.socket, "connect", counted_connect)
    monkeypatch.setattr(hub, "reachable", counted_reachable)
    monkeypatch.setattr(time, "sleep", counted_sleep)
    return seen

