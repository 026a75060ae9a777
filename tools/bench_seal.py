"""What sealing checkpoints (SHA-256 of every byte, :mod:`fedlight.run.atomic`) costs a Fashion-MNIST round.

Runs the FedAvg MLP Fashion-MNIST recipe with a checkpoint every round, alternately with sealing on and off (off:
the digest and the seal skipped, everything else alike), and prints the mean seconds per round (training +
evaluation + the checkpoint's part of the critical path) of each, plus the time of one sealed and one unsealed
``atomic_torch_save`` of the run's own checkpoint.

    PYTHONPATH=. FEDLIGHT_DATA=... python tools/bench_seal.py [--rounds 6] [--pairs 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedlight.config.cli import main
from fedlight.run import atomic

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "fedavg_mlp_fmnist_dir0.1.yaml"


class _Unsealed(atomic._SealingSink):
    """The sink without the digest: bytes are written, nothing is hashed or sealed."""

    def write(self, data) -> int:
        atomic._write_all(self.fd, data, self.path)
        self.size += len(data)
        return len(data)

    def seal(self) -> None:
        pass


def run(out: Path, rounds: int, sealed: bool) -> float:
    real = atomic._SealingSink
    atomic._SealingSink = real if sealed else _Unsealed
    try:
        assert main(["fit", "--config", str(RECIPE), "--out_dir", str(out), "--loop.rounds", str(rounds),
                     "--loop.save_every", "1", "--loop.progress", "false"]) == 0
    finally:
        atomic._SealingSink = real
    import json

    return json.loads((out / "summary.json").read_text())["seconds_per_round_with_eval"]


def save_time(ckpt: dict, folder: Path, sealed: bool, repeats: int = 20) -> float:
    real = atomic._SealingSink
    atomic._SealingSink = real if sealed else _Unsealed
    try:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            atomic.atomic_torch_save(ckpt, folder / "x.ckpt")
            times.append(time.perf_counter() - t)
    finally:
        atomic._SealingSink = real
    return statistics.median(times)


def digest_time(data: bytes, repeats: int = 50) -> float:
    import hashlib

    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        best = min(best, time.perf_counter() - t)
    return best


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--pairs", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        per = {True: [], False: []}
        for i in range(a.pairs):
            for sealed in (False, True) if i % 2 == 0 else (True, False):
                per[sealed].append(run(Path(tmp) / f"run{i}-{sealed}", a.rounds, sealed))
        ckpt_path = Path(tmp) / "run0-True" / "checkpoints" / "last.ckpt"
        ckpt = torch.load(ckpt_path, weights_only=True)
        on, off = save_time(ckpt, Path(tmp), True), save_time(ckpt, Path(tmp), False)
        size = ckpt_path.stat().st_size
        digest = digest_time(ckpt_path.read_bytes())
    s_on, s_off = statistics.mean(per[True]), statistics.mean(per[False])
    print(f"s/round with eval, checkpoint every round: sealed {s_on:.4f} (runs {per[True]}), unsealed {s_off:.4f} "
          f"(runs {per[False]}): {100 * (s_on / s_off - 1):+.2f} %")
    print(f"one checkpoint ({size / 1e6:.2f} MB): sealed save {1e3 * on:.2f} ms, unsealed {1e3 * off:.2f} ms, "
          f"difference {1e3 * (on - off):.2f} ms (medians of 20; noise on a busy machine)")
    print(f"the digest alone (SHA-256 of the checkpoint's bytes, best of 50): {1e3 * digest:.3f} ms = "
          f"{100 * digest / s_off:.4f} % of an unsealed round (written by the background thread, off the critical "
          "path)")


if __name__ == "__main__":
    cli()
