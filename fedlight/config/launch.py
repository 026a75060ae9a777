"""Fabric for a run, and checks every process agrees on."""

from __future__ import annotations

import warnings

import lightning as L

from fedlight.errors import ConfigError


def fabric(accelerator: str, devices: int, num_nodes: int, precision: str):
    """A launched Fabric (``ddp`` for several processes); a setting Lightning refuses is one ConfigError."""
    try:
        with warnings.catch_warnings():  # a machine with Slurm's client tools installed is not a Slurm job
            warnings.filterwarnings("ignore", message="The `srun` command is available")
            fabric = L.Fabric(accelerator=accelerator, devices=devices, num_nodes=num_nodes, precision=precision,
                              strategy="ddp" if devices * num_nodes > 1 else "auto")
    except (ValueError, RuntimeError, TypeError) as e:
        raise ConfigError(f"`accelerator`/`devices`/`precision` ({accelerator}, {devices}, {precision}): "
                          f"{str(e).splitlines()[0]}") from None
    fabric.launch()
    return fabric


def agree(fabric, step) -> None:
    """Run ``step`` (rank 0's part of a check) and make every rank raise the same error if it fails."""
    error = None
    try:
        step()
    except ConfigError as e:
        error = str(e)
    if fabric.world_size > 1:
        error = fabric.broadcast(error, src=0)
    if error is not None:
        raise ConfigError(error)
