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
    bound_gpu_memory(fabric.device)
    return fabric


def bound_gpu_memory(device, env=None) -> float | None:
    """Cap this process's GPU memory at ``FEDLIGHT_GPU_MEMORY_FRACTION`` of the card (set by ``fedlight reproduce
    --per-gpu``, several runs sharing one GPU), saying so; a run that needs more then stops with CUDA's out of memory,
    which the launcher names with its fix. The fraction applied, or None."""
    import os

    text = (os.environ if env is None else env).get("FEDLIGHT_GPU_MEMORY_FRACTION")
    if not text or getattr(device, "type", None) != "cuda":
        return None
    try:
        frac = float(text)
    except ValueError:
        frac = -1.0
    if not 0 < frac <= 1:
        raise ConfigError(f"FEDLIGHT_GPU_MEMORY_FRACTION must be a number in (0, 1], got {text!r}; unset it or fix it")
    import torch

    torch.cuda.set_per_process_memory_fraction(frac, device)
    gib = frac * torch.cuda.get_device_properties(device).total_memory / 2**30
    print(f"fedlight: GPU memory of this run bounded to {gib:.1f} GiB ({frac:g} of {device}; FEDLIGHT_GPU_MEMORY_"
          "FRACTION, runs sharing the GPU)", flush=True)
    return frac


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
