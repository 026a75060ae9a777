"""A real single-node Slurm for the tests (``tools/slurm_single_node.sh``, the script docs/clusters.md shows): the
``slurm_cluster`` fixture installs Debian's packages where they are missing (root and apt-get), starts munged,
slurmctld and slurmd on loopback ports that are free, waits (bounded) for the node to be idle, and stops them at the
end of the session. Where that cannot work the tests that use it are skipped, with the reason."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "slurm_single_node.sh"
START_TIMEOUT_S = 900  # a first apt-get install included; the start alone takes seconds


@dataclass
class SlurmCluster:
    conf: Path  # SLURM_CONF for sbatch, squeue, scontrol, scancel

    def run(self, *cmd: str, timeout: float = 30) -> str:
        """A Slurm client command against this cluster; its stdout."""
        out = subprocess.run(list(cmd), env={**os.environ, "SLURM_CONF": str(self.conf)}, capture_output=True,
                             text=True, timeout=timeout)
        assert out.returncode == 0, f"{' '.join(cmd)}: {out.stderr.strip()}"
        return out.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of a job."""
        line = self.run("scontrol", "show", "job", "-o", job_id).strip()
        return dict(f.split("=", 1) for f in line.split() if "=" in f)

    def wait_for(self, condition, what: str, timeout: float = 600) -> None:  # a bound on a hang only
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
            time.sleep(0.5)

    def start_now(self, job_id: str) -> None:
        """Run a requeued job now instead of after Slurm's requeue delay (two minutes), once it waits for it."""
        self.wait_for(lambda: self.job(job_id).get("Reason") == "BeginTime", f"job {job_id} to be requeued")
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")


def unavailable() -> str | None:
    """Why a single-node Slurm cannot be started here, or None."""
    if os.environ.get("FEDLIGHT_SLURM_TESTS", "1") == "0":
        return "FEDLIGHT_SLURM_TESTS=0"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root: the real-Slurm tests start slurmctld and slurmd as root (tools/slurm_single_node.sh)"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get to install it (slurmctld slurmd slurm-client munge)"
    return None


def free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback (slurmctld's and slurmd's)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535 and all(_free(p) for p in (port, port + 1)):
            return port
    raise RuntimeError("no two free consecutive ports on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="session")
def slurm_cluster():
    why = unavailable()
    if why:
        pytest.skip(f"no real Slurm: {why}")
    folder = Path(tempfile.mkdtemp(prefix="fedlight-slurm-"))  # short: the munge socket's path has a length limit
    env = {**os.environ, "FEDLIGHT_SLURM_PORT": str(free_port_pair()), "FEDLIGHT_SLURM_WAIT": "60",
           "FEDLIGHT_SLURM_KILLWAIT": "10"}  # a stopped job's processes go 10 s after its SIGTERM (tiny rounds)
    try:
        started = subprocess.run(["bash", str(SCRIPT), "start", str(folder)], env=env, capture_output=True,
                                 text=True, timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        started = None
    try:
        if started is None or started.returncode != 0:
            detail = "timed out" if started is None else (started.stderr.strip().splitlines() or ["?"])[-1]
            pytest.skip(f"no real Slurm: tools/slurm_single_node.sh start failed: {detail}")
        yield SlurmCluster(folder / "slurm.conf")
    finally:
        try:
            subprocess.run(["bash", str(SCRIPT), "stop", str(folder)], env=env, capture_output=True, timeout=120)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
