"""Per-client state store: each client's persistent state (``c_i``, ``h_i``, momenta) keyed by client id.

State belongs to the client id and survives rounds in which the client is not sampled. The store
keeps it off the accelerator by default (``device="cpu"``) so thousands of stateful clients do not
need thousands of models in accelerator memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _map(obj: Any, fn):
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


class ClientStateStore:
    """Maps client id → state dict (tensors, dicts of tensors, numbers).

    Args:
        device: where stored state lives: ``"cpu"`` (default) or an accelerator device.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[int, dict[str, Any]] = {}

    def get(self, client_id: int, device: torch.device | str) -> dict[str, Any]:
        """A private copy of the client's state on ``device`` (empty dict for a new client)."""
        state = self._states.get(client_id)
        if state is None:
            return {}
        return _map(state, lambda t: t.to(device, copy=True))

    def put(self, client_id: int, state: dict[str, Any]) -> None:
        """Store (a copy of) the client's state; an empty state stores nothing."""
        if state:
            self._states[client_id] = _map(state, lambda t: t.detach().to(self.device, copy=True))

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def ids(self) -> list[int]:
        return sorted(self._states)

    def state_dict(self) -> dict[str, Any]:
        return {"states": {int(k): v for k, v in self._states.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._states = {int(k): _map(v, lambda t: t.to(self.device)) for k, v in d["states"].items()}
