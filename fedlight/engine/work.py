"""What a round hands out to train, and the driver of a round (or a run) written as a generator of it.

A round is a generator (:meth:`FederatedLoop.round_steps <fedlight.engine.loop.FederatedLoop.round_steps>`): it
yields its :class:`Work` and is sent the outcomes. Alone, :func:`drive` trains each Work with the run's own runner; a
lockstep group (:mod:`fedlight.engine.lockstep`) trains the Works of several runs together.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedlight.core.params import Params
    from fedlight.core.rules import RoundInfo
    from fedlight.runners.base import ClientJob


@dataclass(eq=False)
class Work:
    """The clients a round hands out: ``runner.train(jobs, info, buffers)`` trains them (lazily, in job order)."""

    jobs: list[ClientJob]
    info: RoundInfo
    buffers: Params
    """The global floating-point buffers the clients start from."""
    runner: Any

    def run(self):
        """Train the clients with the run's own runner: their outcomes, lazily, in job order."""
        return self.runner.train(self.jobs, self.info, self.buffers)


@dataclass(eq=False)
class Evaluation:
    """A run's global model to evaluate (a lockstep group evaluates its runs' models in one pass)."""

    driver: Any
    """The run's :class:`~fedlight.engine.driver.FitDriver`."""

    def run(self) -> dict[str, float]:
        return self.driver.evaluate()


def drive(steps: Generator[Work | Evaluation, Any, Any]) -> Any:
    """Run ``steps`` to its end, each :class:`Work` it yields trained by its own runner, each :class:`Evaluation`
    evaluated alone; its return value."""
    try:
        work = next(steps)
        while True:
            work = steps.send(work.run())
    except StopIteration as done:
        return done.value
