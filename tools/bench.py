#!/usr/bin/env python
"""Benchmark fedlight against a minimal hand-written PyTorch FedAvg loop (see ``fedlight/lab/benchmarks/cli.py``).

    python tools/bench.py                      # whole `fedlight fit` (FMNIST recipe) vs a minimal loop, wall, 1 thread
    python tools/bench.py --overhead           # round by round: MLP and LeNet-5, fedlight vs minimal vs vmap
    python tools/bench.py --all                # + 2-process speedup, 10,000-client SCAFFOLD, GPU (if any)
    python tools/bench.py --gpu                # ResNet-18-CIFAR-100 bf16, FedAvg + FedSAM (needs CUDA)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedlight.lab.benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
