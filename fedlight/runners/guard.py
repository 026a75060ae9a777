"""What keeps a client runner from dying on a user's first run: out-of-memory messages, the ``auto`` chunk size,
and the one-line causes of a failed compilation.

* Out of memory in a stacked chunk: :class:`~fedlight.runners.stacked.StackedRunner` halves the chunk and redoes it;
  a single client that still does not fit (or any client of the sequential runner) ends the run with
  :class:`OutOfMemory`, one message listing the fixes.
* ``loop.vmap_chunk: auto``: :func:`auto_chunk` from the device's free memory (:func:`free_bytes`) and the model's
  per-client footprint (:func:`client_footprint`: saved activations of one forward pass, measured, plus the
  parameter-sized copies a client holds).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from fedlight.errors import ConfigError

OOM_FIXES = ("a smaller batch (`--data.init_args.batch_size`), `--precision bf16-mixed`, fewer clients per stacked "
             "chunk (`--loop.vmap_chunk N`, or `--loop.client_parallelism sequential`)")

PARAM_COPIES = 5
"""Parameter-sized tensors one stacked client holds: parameters, gradients, broadcast, optimizer or rule buffer,
and one temporary (a rule with more state adds its state bytes on top)."""

HEADROOM = 0.6
"""Share of the free memory ``auto`` plans to fill (the rest: allocator fragmentation, evaluation, the store)."""


class OutOfMemory(ConfigError):
    """The device ran out of memory training one client; the message lists the fixes."""


def say(setup: Any, message: str) -> None:
    """Print one ``fedlight:`` line (rank 0 under Fabric; stderr without one)."""
    fabric = getattr(setup, "fabric", None)
    if fabric is not None and hasattr(fabric, "print"):
        fabric.print(message, file=sys.stderr, flush=True)
    else:
        print(message, file=sys.stderr, flush=True)


def is_oom(e: BaseException) -> bool:
    """``e`` is, or was raised from, a device out-of-memory error."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, torch.OutOfMemoryError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def cause(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters), for a one-line notice."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def out_of_memory(runner: str, client_id: int, device: Any) -> OutOfMemory:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return OutOfMemory(f"out of memory on {device} training client {client_id} with the {runner} runner; "
                       f"fixes: {OOM_FIXES}")


def free_bytes(device: torch.device) -> int:
    """Memory free for new tensors on ``device`` (CUDA: the driver's count; CPU: ``MemAvailable``)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError):
        return 2**32  # unknown: assume 4 GiB


def activation_bytes(model: nn.Module, batch: Any, objective) -> int:
    """Bytes autograd saves for the backward of one forward pass of ``objective(model, batch)`` (measured)."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        key = (t.untyped_storage().data_ptr(), t.device)
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        objective(model, batch)
    return sum(seen.values())


def client_footprint(model: nn.Module, batch: Any, objective, state_bytes: int = 0) -> int:
    """Per-client bytes of a stacked chunk: measured activations of one batch, ``PARAM_COPIES`` parameter-sized
    copies, the client's state."""
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return activation_bytes(model, batch, objective) + PARAM_COPIES * params + state_bytes


def tree_bytes(tree: Any) -> int:
    """Bytes of every tensor in a (nested) dict."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    return sum(tree_bytes(v) for v in tree.values()) if isinstance(tree, dict) else 0


def auto_chunk(free: int, per_client: int, clients: int, headroom: float = HEADROOM) -> int:
    """Clients per chunk: as many as fit in ``headroom × free``, at least 1, at most ``clients``."""
    fit = int(headroom * free) // max(per_client, 1)
    return max(1, min(clients, fit))
