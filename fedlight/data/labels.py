"""Class labels that are not integers (``"cat"``, ``"dog"`` ...): mapped to class indices, with the mapping printed,
or refused in one line naming ``label_fn``."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlight.errors import ConfigError


def label_tensor(values: Any, where: str, in_batches: bool = True) -> tuple[Tensor, dict[Any, int] | None]:
    """``values`` (a dataset's ``targets``, or ``label_fn`` over its samples) as a tensor, and the mapping used
    when they are strings (sorted names → 0, 1, ...; printed once, saying whether the batches' labels are mapped too:
    ``in_batches``); other labels that are not numbers are refused."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):
        array = np.asarray(list(values), dtype=object)
    if array.dtype.kind in "biuf":
        return torch.as_tensor(array), None
    flat = array.reshape(-1).tolist()
    if array.ndim != 1 or not all(isinstance(v, str) for v in flat):
        kinds = sorted({type(v).__name__ for v in flat})
        raise ConfigError(f"the class labels from {where} are {', '.join(kinds)} values, which cannot be class "
                          "indices; pass `label_fn` (sample -> an int or a str class name) that returns them")
    mapping = {name: i for i, name in enumerate(sorted(set(flat)))}
    shown = ", ".join(f"{k!r}: {v}" for k, v in list(mapping.items())[:20]) + (", ..." if len(mapping) > 20 else "")
    if in_batches:
        print(f"fedlight: note: string labels from {where} mapped to class indices {{{shown}}}", file=sys.stderr)
    else:
        print(f"fedlight: note: string labels from {where} read as classes {{{shown}}} to split the clients; the "
              "batches keep them as your loader yields them", file=sys.stderr)
    return torch.as_tensor([mapping[v] for v in flat], dtype=torch.int64), mapping


def map_batch(batch: Any, mapping: dict[Any, int] | None) -> Any:
    """A collated ``(x, labels)`` batch whose labels are strings, with the labels as class indices."""
    if mapping is None or not isinstance(batch, (list, tuple)) or len(batch) < 2:
        return batch
    labels = batch[-1]
    if not isinstance(labels, (list, tuple)) or not labels or not all(isinstance(v, str) for v in labels):
        return batch
    unknown = sorted({v for v in labels if v not in mapping})
    if unknown:
        raise ConfigError(f"labels {unknown[:3]} are not among the training labels {sorted(mapping)[:5]}...; pass "
                          "`label_fn` so that every set uses the same class names")
    return type(batch)([*batch[:-1], torch.as_tensor([mapping[v] for v in labels], dtype=torch.int64)])
