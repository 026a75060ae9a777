"""Many runs of a table on one GPU at once (``fedlight reproduce --per-gpu N|auto``).

A small model's round (LeNet-5 on CIFAR-10) is mostly host work: one process leaves the GPU idle most of the time,
so a table's throughput (rounds per second of all its runs together) grows with the processes sharing the card,
until the CPU cores or the GPU memory run out. This module decides how many share it and sets up what they share:

* **CPU threads split**: each process gets ``cores // N`` intra-op and compile threads (``OMP_NUM_THREADS``,
  ``TORCHINDUCTOR_COMPILE_THREADS``), so N processes do not fight over the cores;
* **one compile cache** (``TORCHINDUCTOR_CACHE_DIR``, the FX graph and AOT autograd caches on) and **one decoded
  data cache** (``FEDLIGHT_CACHE``): the first run starts alone and the others once it has finished a round
  (:class:`FirstRun`), so only it compiles and decodes; the others read both caches;
* **GPU memory bounded**: each process may take ``0.95 / N`` of the card
  (``FEDLIGHT_GPU_MEMORY_FRACTION``, applied by :func:`fedlight.config.launch.bound_gpu_memory`), and a run that
  runs out of its share is named with the fix (:func:`memory_hint`).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from fedlight.errors import check

GIB_PER_RUN = 2.0
"""GPU memory ``--per-gpu auto`` plans per process (a CUDA context, a small model's stacked clients and its
compiled graphs); bigger models need a smaller explicit ``--per-gpu``."""
FRACTION_ENV = "FEDLIGHT_GPU_MEMORY_FRACTION"


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose(per_gpu: str | int, runs: int, cores: int, gpu_gib: float) -> tuple[int, str]:
    """How many runs share each GPU, and why (one line). ``per_gpu``: a number, or ``auto`` = as many as there are
    runs to do, CPU cores (one each: the host side of a small model's step is what bounds it) and
    :data:`GIB_PER_RUN` slices of the card's memory allow."""
    if str(per_gpu) != "auto":
        n = int(per_gpu)
        check(n >= 1, f"`--per-gpu` must be a positive number or auto, got {per_gpu}")
        return n, f"--per-gpu {n}"
    by_mem = max(1, math.floor(gpu_gib / GIB_PER_RUN))
    n = max(1, min(runs, cores, by_mem))
    limit = min((runs, "runs to do"), (cores, "CPU cores"), (by_mem, f"{GIB_PER_RUN:g} GiB slices of GPU memory"))
    return n, (f"--per-gpu auto: {runs} runs to do, {cores} CPU cores, {gpu_gib:.0f} GiB of GPU memory "
               f"({by_mem} slices of {GIB_PER_RUN:g} GiB) -> {n}, bounded by the {limit[1]}")


def parse_per_gpu(text: str | None) -> str | int | None:
    """``--per-gpu`` as given: None, ``auto`` or a positive number."""
    if text is None or text == "auto":
        return text
    check(text.isdigit() and int(text) >= 1, f"`--per-gpu` takes a positive number or auto, got {text!r}")
    return int(text)


def share_env(env: dict[str, str], per_gpu: int) -> tuple[dict[str, str], str]:
    """``env`` for N processes sharing one GPU (variables already set win), and a line saying what is shared: the
    decoded data cache (``FEDLIGHT_CACHE``, default ``~/.cache/fedlight``) and the compile cache beside it."""
    from fedlight.data.cache import cache_dir

    threads = str(max(1, cpu_cores() // per_gpu))
    out = dict(env)
    data = Path(out["FEDLIGHT_CACHE"]).expanduser() if out.get("FEDLIGHT_CACHE") else cache_dir()
    out["FEDLIGHT_CACHE"] = str(data)
    out.setdefault("OMP_NUM_THREADS", threads)
    out.setdefault("TORCHINDUCTOR_COMPILE_THREADS", threads)
    out.setdefault("TORCHINDUCTOR_CACHE_DIR", str(data / "inductor"))
    out.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    out.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    if per_gpu > 1:
        out.setdefault(FRACTION_ENV, f"{0.95 / per_gpu:.4f}")
    frac = out.get(FRACTION_ENV)
    return out, (f"each process: {out['OMP_NUM_THREADS']} CPU thread(s), GPU memory "
                 f"{'bounded to ' + frac + ' of the card' if frac else 'not bounded'}; compile cache "
                 f"{out['TORCHINDUCTOR_CACHE_DIR']} and data cache {out['FEDLIGHT_CACHE']} shared")


class FirstRun:
    """Holds every run but the first until the first has finished a round (its ``metrics.jsonl`` grew) or ended,
    so that the caches it fills (compiled graphs, decoded data) are read, not rebuilt, by the others."""

    def __init__(self, path: Path, poll_s: float = 0.5, limit_s: float = 900.0) -> None:
        self.metrics = Path(path) / "metrics.jsonl"
        self.low = self._size()  # the smallest size seen: a resumed run may first cut rows past its checkpoint
        self.ended = False
        self.poll_s, self.limit_s = poll_s, limit_s

    def _size(self) -> int:
        try:
            return self.metrics.stat().st_size
        except OSError:
            return 0

    def open(self) -> bool:
        size = self._size()
        self.low = min(self.low, size)
        return self.ended or size > self.low

    def wait(self, stop=lambda: False) -> None:
        t0 = time.time()
        while not self.open() and not stop() and time.time() - t0 < self.limit_s:
            time.sleep(self.poll_s)


def memory_hint(log: Path, fraction: str | None = None) -> str:
    """For a failed run: the fix when its ``fit.log`` shows the GPU ran out of memory; else ''."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 20000))
            tail = f.read().decode(errors="replace").lower()
    except OSError:
        return ""
    if "out of memory" not in tail:
        return ""
    share = f" (its share: {fraction} of the card, {FRACTION_ENV})" if fraction else ""
    return (f" — out of GPU memory{share}: run fewer at once (a smaller --per-gpu N, or --per-gpu 1), or lower "
            "loop.vmap_chunk through --fit-args")


def rounds_in(path: Path) -> int:
    """Rounds a run folder has recorded (lines of its ``metrics.jsonl``)."""
    try:
        with open(Path(path) / "metrics.jsonl", "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0
