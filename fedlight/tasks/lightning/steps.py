"""The stand-in trainer's ``global_step`` counted across rounds, and what a fedlight checkpoint keeps of a
LightningModule's run (the steps learned per round among it), as a part of :class:`.task.LightningTask`."""

from __future__ import annotations

from typing import Any

from torch import nn


class GlobalSteps:
    """``global_step`` at a client's round and after a round, and the task's checkpoint state; mixed into
    :class:`.task.LightningTask`, whose ``__init__`` sets the attributes below."""

    manual: bool  # automatic_optimization = False
    round: int
    steps: int  # K, the local steps of the round
    round_steps: dict[int, int]  # manual optimisation: optimizer steps a client of K batches takes
    trainer: Any
    module: Any

    def step_offset(self, round: int, steps: int) -> int:
        """``global_step`` when a client of ``steps`` batches begins round ``round``: the optimizer steps a Trainer
        fitting that client would have counted in the rounds before (``K`` a round under automatic optimisation;
        under manual optimisation the ``S`` a client of ``K`` batches took, learned from its first round)."""
        if not self.manual:
            return round * steps
        if steps not in self.round_steps and self.round_steps:  # a client size not seen yet: the nearest one's rate
            near = min(self.round_steps, key=lambda k: abs(k - steps))
            return round * round_half(self.round_steps[near] * steps / near)
        return round * self.round_steps.get(steps, steps)

    def learned_steps(self, steps: int, taken: int) -> None:
        if self.manual:
            self.round_steps.setdefault(steps, taken)

    def total_steps(self, round: int) -> int:
        """``global_step`` once round ``round`` is done (evaluation, the checkpoints)."""
        return self.step_offset(round + 1, self.steps)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a fedlight checkpoint keeps of the module (:mod:`.checkpoint`): its ``on_save_checkpoint`` extras and
        its DataModule's ``state_dict``, as Lightning's checkpoint holds them, and the steps learned per round."""
        from fedlight.tasks.lightning.checkpoint import extras

        if self.trainer is None:
            return {}
        return {"extras": extras(self.module, self.round, self.total_steps(self.round), self.trainer.datamodule),
                "round_steps": dict(self.round_steps)}

    def load_checkpoint_state(self, state: dict[str, Any], model: nn.Module) -> None:
        """On ``--resume``: the DataModule's ``load_state_dict`` and the module's ``on_load_checkpoint``, as
        Lightning's Trainer restores a checkpoint."""
        from fedlight.tasks.lightning.checkpoint import restore

        if self.trainer is None or not state:
            return
        self.round_steps.update(state.get("round_steps", {}))
        restore(self.module, state.get("extras", {}), self.trainer.datamodule)


def round_half(x: float) -> int:
    return int(x + 0.5)
