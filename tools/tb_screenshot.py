"""Screenshots of TensorBoard showing runs fedlight has just made (for the docs; a tool, not a test).

    python tools/tb_screenshot.py                 # writes docs/img/tensorboard_*.png
    python tools/tb_screenshot.py --keep /tmp/tb  # keep the runs (and look at them yourself)

Trains the quickstart recipe with two rules (FedAvg, FedSAM), starts a real ``tensorboard`` process serving their
run directories, and photographs its dashboards with headless Chromium (``apt-get install -y chromium``): the
per-round test and train scalars, Custom Scalars (the layout fedlight writes) and HParams (one row per run). The URL
fragment picks the dashboard; ``--virtual-time-budget`` lets the page render before the picture is taken.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "img"
# name: (URL fragment, window size); the scalars dashboard filtered to the per-round test and train curves, unsmoothed
DASHBOARDS = {"scalars": ("scalars&tagFilter=%5E(test%2F%7Ctrain%2Floss)&_smoothingWeight=0", "1400,900"),
              "custom_scalars": ("custom_scalars", "1400,900"),
              "hparams": ("hparams", "1900,600")}
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def train(runs: Path, rounds: int) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for algo in ("fedavg", "fedsam"):
        cmd = [sys.executable, "-m", "fedlight", "fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
               "--algorithm", algo, "--loop.rounds", str(rounds), "--out_dir", str(runs / f"quickstart_{algo}")]
        subprocess.run(cmd, check=True, env=env, cwd=runs, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(runs: Path, port: int, timeout_s: float) -> subprocess.Popen:
    """A ``tensorboard`` process on ``runs``, returned once its HTTP server answers (or raise after timeout_s)."""
    proc = subprocess.Popen([shutil.which("tensorboard") or "tensorboard", "--logdir", str(runs), "--port", str(port),
                             "--host", "127.0.0.1", "--reload_interval", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tensorboard exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=2) as r:
                if b"quickstart" in r.read():  # the runs are loaded, not only the server up
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"tensorboard did not serve the runs within {timeout_s:.0f} s")


def screenshot(url: str, path: Path, size: str, budget_ms: int) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("no chromium on PATH: apt-get install -y chromium")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={path}",
                        f"--window-size={size}", f"--virtual-time-budget={budget_ms}", url],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=180)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--out", type=Path, default=OUT, help="folder for the PNGs (default docs/img)")
    p.add_argument("--keep", type=Path, help="train into this folder and keep it (default: a temporary one)")
    p.add_argument("--budget-ms", type=int, default=15000, help="virtual time the page gets to render")
    args = p.parse_args(argv)
    runs = args.keep or Path(tempfile.mkdtemp(prefix="fedlight_tb_"))
    runs.mkdir(parents=True, exist_ok=True)
    try:
        train(runs, args.rounds)
        port = free_port()
        tb = serve(runs, port, timeout_s=120)
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            for name, (fragment, size) in DASHBOARDS.items():
                path = args.out / f"tensorboard_{name}.png"
                screenshot(f"http://127.0.0.1:{port}/#{fragment}", path, size, args.budget_ms)
                print(f"{path}  {path.stat().st_size / 1000:.0f} kB")
        finally:
            tb.terminate()
            tb.wait(timeout=30)
    finally:
        if args.keep is None:
            shutil.rmtree(runs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
