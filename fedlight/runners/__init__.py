"""Client runners: how the clients of a round are executed (the round itself does not care).

* :class:`SequentialRunner` — one client after another on the one model; the reference, and the CPU default.
* :class:`StackedRunner` — the clients of a round stacked along a client dimension (``torch.func.vmap``), the
  stacked loss optionally ``torch.compile``d; the default on CUDA. With ``loop.channels_last`` its convolutions
  stay channels-last (:class:`~fedlight.runners.nhwc.ChannelsLastStackedRunner`).
* :class:`StreamsRunner` — a chunk's clients on their own model copies, their steps interleaved on CUDA streams, each
  copy with CUDA graphs: for the models and rules that cannot run stacked exactly (dropout).
* :class:`~fedlight.runners.graphed.GraphedStackedRunner` — the stacked runner with each whole step replayed from a
  CUDA graph (``loop.client_parallelism: graphs``; chosen explicitly, not yet by ``auto``).

:func:`select_runner` turns ``loop.client_parallelism`` / ``loop.compile`` into a runner and says why; ``auto``
reads :data:`fedlight.runners.choice.AUTO`.
"""

from __future__ import annotations

from fedlight.errors import ConfigError
from fedlight.runners.base import ClientJob, ClientOutcome, ClientRunner, TrainSetup, compile_kwargs
from fedlight.runners.choice import _drops as _drops  # re-exported: tests and tasks read it here
from fedlight.runners.choice import pick_route
from fedlight.runners.graphed import GraphedStackedRunner, graphs_blocker
from fedlight.runners.guard import say
from fedlight.runners.nhwc import ChannelsLastStackedRunner
from fedlight.runners.sequential import SequentialRunner
from fedlight.runners.stacked import StackedRunner, check_supported
from fedlight.runners.streams import StreamsRunner, streams_compile

__all__ = ["ClientJob", "ClientOutcome", "ClientRunner", "SequentialRunner", "StackedRunner", "StreamsRunner",
           "TrainSetup", "select_runner"]


def select_runner(cfg, setup: TrainSetup, algorithm: str) -> tuple[ClientRunner, str]:
    """The runner ``cfg`` asks for (``auto``: the first route of :data:`~fedlight.runners.choice.AUTO` for the
    device that the rule and model allow), and a one-line reason."""
    mode, compile = cfg.client_parallelism, _compile_on(cfg.compile, setup)
    channels_last = getattr(cfg, "channels_last", False)
    if mode == "auto":
        route, reason = pick_route(setup)
        mode = "vmap" if route.runner == "stacked" else route.runner
        compile = _compile_on(route.compile, setup) if compile is None else compile  # the route's own compile
        channels_last = channels_last or route.channels_last
    else:
        reason = f"loop.client_parallelism: {mode}"
        if mode == "vmap":
            check_supported(setup.local, algorithm)
            if any(_drops(m) for m in setup.model.modules()):
                say(setup, "fedlight: note: the model has dropout; stacked clients (`loop.client_parallelism: vmap`) "
                           "draw their masks per stacked client, so the numbers differ from sequential training "
                           "(equal only in distribution); `sequential` or `streams` reproduce it exactly")
    if mode == "graphs":
        why = graphs_blocker(setup)
        if why is not None:
            raise ConfigError(f"`loop.client_parallelism: graphs` cannot run {algorithm}: {why}. Use "
                              "`loop.client_parallelism: vmap` (eager stacked) or `sequential`")
        if compile or channels_last:
            say(setup, "fedlight: note: `loop.client_parallelism: graphs` runs the eager stacked step in CUDA graphs; "
                       "`loop.compile` and `loop.channels_last` are not used on this route")
        return GraphedStackedRunner(setup, cfg.vmap_chunk), reason
    if mode == "vmap":
        cls = ChannelsLastStackedRunner if channels_last else StackedRunner
        return cls(setup, cfg.vmap_chunk, compile or False), reason
    if mode == "streams":
        chunk = cfg.vmap_chunk if isinstance(cfg.vmap_chunk, int) else None
        return StreamsRunner(setup, chunk, streams_compile(compile, setup.device)), reason
    if compile:
        setup.model.compile(**compile_kwargs(compile))
    return SequentialRunner(setup), reason


def _compile_on(compile, setup: TrainSetup):
    """``loop.compile`` as it applies to the device: CUDA graphs (``reduce-overhead``) exist only on CUDA."""
    if compile == "reduce-overhead" and setup.device.type != "cuda":
        say(setup, f"fedlight: note: `loop.compile: reduce-overhead` adds CUDA graphs, which need a CUDA device; on "
                   f"{setup.device.type} it compiles as `loop.compile: true` does")
        return True
    return compile
