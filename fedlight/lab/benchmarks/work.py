"""The work ``fedlight bench --peers`` hands every side (one file: initial weights, data, client lists, settings),
and reading it back, and the one clock every side is timed by (:class:`RoundClock`); shared by the fedlight,
minimal and pfl sides (:mod:`fedlight.lab.benchmarks.peers`, :mod:`fedlight.lab.benchmarks.pfl`)."""

from __future__ import annotations

import functools
import time
from pathlib import Path


class RoundClock:
    """The clock of every side: :meth:`tick` at the end of each round, after its evaluation (directly, or
    :meth:`after` the side's round-end function). The ticks are ``time.monotonic()`` (Linux: ``CLOCK_MONOTONIC``,
    one clock for every process of the machine), so the driver reads them against its own readings around the
    side's process; a round's time is the interval between two ticks, whatever the side did in it (training,
    evaluation, checkpoint, logging), never a time the side reports itself."""

    def __init__(self, out: dict) -> None:
        self.ticks = out.setdefault("ticks", [])

    def tick(self) -> None:
        self.ticks.append(time.monotonic())

    def after(self, fn):
        """``fn``, ticking when it returns."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            result = fn(*args, **kwargs)
            self.tick()
            return result
        return timed


def _digest(state: dict) -> str:
    import hashlib

    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode() + state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def mlp_like(init: dict, cls=None):
    """A ``fedlight.models.MLP`` (or subclass ``cls``) of the shape of the state ``init``, holding ``init``."""
    from fedlight.models import MLP

    ws = [v for k, v in init.items() if k.endswith("weight")]
    model = (cls or MLP)(ws[0].shape[1], [w.shape[0] for w in ws[:-1]], ws[-1].shape[0])
    model.load_state_dict(init)
    return model


def load_work(path: str):
    """The shared work, on the GPU when there is one (as ``fedlight fit`` and pfl choose): (init state, normalized
    client data getter, test set, spec)."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in torch.load(path, weights_only=True).items()}
    w["parts"] = [p.to(dev) for p in w["parts"]]
    norm = (lambda x: x.float() * w["scale"] + w["shift"]) if w["scale"] is not None else (lambda x: x.float())

    def client(cid: int):
        idx = w["parts"][cid]
        return norm(w["train_x"][idx]), w["train_y"][idx]

    return w["init"], client, (norm(w["test_x"]), w["test_y"]), w["spec"]


def _peak_rss_mb() -> float:
    """This process's peak resident memory: ``VmHWM`` (``ru_maxrss`` would count the parent's memory at the fork)."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
