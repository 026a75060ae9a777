"""Client runners: how the clients of a round are executed (the round itself does not care).

* :class:`SequentialRunner` — one client after another on the one model; the reference, and the CPU default.
* :class:`StackedRunner` — the clients of a round stacked along a client dimension (``torch.func.vmap``), the
  stacked loss optionally ``torch.compile``d; the default on CUDA.

:func:`select_runner` turns ``loop.client_parallelism`` / ``loop.compile`` into a runner and says why.
"""

from __future__ import annotations

import numbers

from torch import nn

from fedlight.runners.base import ClientJob, ClientOutcome, ClientRunner, TrainSetup
from fedlight.runners.guard import say
from fedlight.runners.sequential import SequentialRunner
from fedlight.runners.stacked import COMPILE_MODES, StackedRunner, check_supported

__all__ = ["ClientJob", "ClientOutcome", "ClientRunner", "SequentialRunner", "StackedRunner", "TrainSetup",
           "select_runner"]


def select_runner(cfg, setup: TrainSetup, algorithm: str) -> tuple[ClientRunner, str]:
    """The runner ``cfg`` asks for (``auto``: stacked + compiled on CUDA when the rule and model allow it,
    else sequential), and a one-line reason."""
    mode, compile = cfg.client_parallelism, _compile_on(cfg.compile, setup)
    if mode == "vmap":
        check_supported(setup.local, algorithm)
        return StackedRunner(setup, cfg.vmap_chunk, compile or False), "loop.client_parallelism: vmap"
    if mode == "auto":
        why = _why_not_stacked(setup)
        if why is None:
            c = True if compile is None else compile
            return StackedRunner(setup, cfg.vmap_chunk, c), "auto: CUDA device; rule and model run stacked"
        reason = f"auto: {why}"
    else:
        reason = "loop.client_parallelism: sequential"
    if compile:
        setup.model.compile(**({} if compile is True else {"mode": compile} if compile in COMPILE_MODES
                               else {"backend": compile}))
    return SequentialRunner(setup), reason


def _drops(m: nn.Module) -> bool:
    """Dropout with p > 0, or stochastic depth (timm's ``DropPath`` with ``drop_prob > 0``, as in Swin/ViT)."""
    if isinstance(m, nn.modules.dropout._DropoutNd):
        return m.p > 0
    p = getattr(m, "drop_prob", None)
    return isinstance(p, numbers.Real) and p > 0


def _compile_on(compile, setup: TrainSetup):
    """``loop.compile`` as it applies to the device: CUDA graphs (``reduce-overhead``) exist only on CUDA."""
    if compile == "reduce-overhead" and setup.device.type != "cuda":
        say(setup, f"fedlight: note: `loop.compile: reduce-overhead` adds CUDA graphs, which need a CUDA device; on "
                   f"{setup.device.type} it compiles as `loop.compile: true` does")
        return True
    return compile


def _why_not_stacked(setup: TrainSetup) -> str | None:
    if setup.device.type != "cuda":
        return f"{setup.device.type} device (stacked clients pay off on CUDA; force with vmap)"
    if setup.local.stacked_unsupported is not None:
        return f"the rule cannot run stacked ({setup.local.stacked_unsupported})"
    if any(_drops(m) for m in setup.model.modules()):
        return "the model has dropout (stacked clients draw different masks than sequential ones)"
    return getattr(setup.task, "stacked_note", None)
