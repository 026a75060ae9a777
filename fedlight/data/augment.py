"""Batched image augmentation as tensor ops on the device (no per-sample Python, no DataLoader).

Parameters are drawn separately (:meth:`CropFlip.sample`, on CPU, from a given ``torch.Generator``) from
their application (:meth:`CropFlip.apply`, on the device), so a caller can draw all of them up front,
move them to the device in one copy and slice per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def crop_flip(x: Tensor, shift_y: Tensor, shift_x: Tensor, flip: Tensor) -> Tensor:
    """Shift each image with zero fill, then mirror it left-right where ``flip`` is set.

    ``out[b, :, i, j] = x[b, :, i + shift_y[b], j' + shift_x[b]]`` with ``j' = W-1-j`` when ``flip[b]``
    (else ``j``), and 0 where the source lies outside the image. A shift ``s`` in ``[-pad, pad]`` is
    exactly torchvision's ``RandomCrop(size, padding=pad)`` at offset ``s + pad`` of the zero-padded image,
    followed by ``RandomHorizontalFlip``.

    Args:
        x: Images ``[B, C, H, W]`` of any dtype (uint8 in fedlight, so the fill is raw pixel 0).
        shift_y: ``[B]`` integer row shifts.
        shift_x: ``[B]`` integer column shifts.
        flip: ``[B]`` bool, mirror after the shift.

    Returns:
        A new contiguous tensor shaped and typed like ``x``.
    """
    b, _, h, w = x.shape
    rows = torch.arange(h, device=x.device)[None, :] + shift_y[:, None]  # [B, H]
    cols = torch.arange(w, device=x.device).expand(b, w)
    cols = torch.where(flip[:, None], w - 1 - cols, cols) + shift_x[:, None]  # [B, W]
    valid = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]  # [B, H, W]
    batch = torch.arange(b, device=x.device)[:, None, None]
    out = x[batch, :, rows.clamp(0, h - 1)[:, :, None], cols.clamp(0, w - 1)[:, None, :]]  # [B, H, W, C]
    out = out.masked_fill(~valid[..., None], 0)
    return out.permute(0, 3, 1, 2).contiguous()


@dataclass(frozen=True)
class CropFlip:
    """Random crop with zero padding plus random horizontal flip (the standard CIFAR recipe).

    Applied to the raw uint8 pixels before normalisation, so the padding is black (pixel 0), as with
    torchvision's ``RandomCrop(32, padding=4)`` on a PIL image before ``ToTensor``/``Normalize``
    (the seed papers' "J" code). FedDyn-style code pads after normalisation instead (fill = mean).

    Args:
        pad: Padding in pixels on each side; the crop offset is uniform in ``[0, 2 * pad]``.
        flip: Whether to flip left-right with probability 1/2.
    """

    pad: int = 4
    flip: bool = True

    param_width = 3
    """Columns of :meth:`sample`'s result."""

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        """Draw parameters for ``n`` images on CPU: an int64 ``[n, 3]`` tensor (shift_y, shift_x, flip)."""
        shifts = torch.randint(-self.pad, self.pad + 1, (n, 2), generator=generator)
        if self.flip:
            flips = torch.randint(0, 2, (n, 1), generator=generator)
        else:
            flips = torch.zeros(n, 1, dtype=torch.int64)
        return torch.cat([shifts, flips], dim=1)

    def apply(self, x: Tensor, params: Tensor) -> Tensor:
        """Augment the batch ``x`` ``[B, C, H, W]`` with the rows of ``params`` (on ``x``'s device)."""
        return crop_flip(x, params[:, 0], params[:, 1], params[:, 2].bool())


def resize(x: Tensor, size: int, mode: str = "bilinear") -> Tensor:
    """Resize images ``[B, C, H, W]`` to ``size × size`` (``mode``: bilinear or bicubic, antialiased; when enlarging
    that is the plain filter), rounded back to ``x``'s dtype for integer images; a batch already of that size is
    returned as it is."""
    if x.shape[-2:] == (size, size):
        return x
    out = F.interpolate(x.float(), size=(size, size), mode=mode, align_corners=False, antialias=True)
    if x.dtype.is_floating_point:
        return out.to(x.dtype)
    return out.round_().clamp_(0, 255).to(x.dtype)


@dataclass(frozen=True)
class Chain:
    """Augmentations applied one after another (e.g. ``CropFlip`` then ``RandAugment``).

    Each step's int64 parameters take their own columns of the one parameter tensor, so a caller still draws
    all of them up front, moves them in one copy and slices rows per batch.

    Args:
        steps: Objects with ``sample(n, generator) -> int64 [n, param_width]``, ``apply(x, params)`` and
            ``param_width``.
    """

    steps: tuple

    @property
    def param_width(self) -> int:
        """Columns of :meth:`sample`'s result."""
        return sum(s.param_width for s in self.steps)

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        """Draw every step's parameters for ``n`` images, in order, and put them side by side."""
        return torch.cat([s.sample(n, generator).long() for s in self.steps], dim=1)

    def apply(self, x: Tensor, params: Tensor) -> Tensor:
        """Apply the steps in order, each to its own columns of ``params``."""
        start = 0
        for s in self.steps:
            x = s.apply(x, params[:, start:start + s.param_width])
            start += s.param_width
        return x


def adopt_preprocessing(model: Any, data: Any) -> str | None:
    """Give an image data module the pretrained model's preprocessing (``model.preprocessing_config``: mean, std,
    interpolation; :class:`fedlight.models.Timm`) before ``setup``; returns the line the run prints, or None when
    the model brings none (the data module's statistics and bilinear resizing stay)."""
    cfg = getattr(model, "preprocessing_config", None)
    if not cfg or not hasattr(data, "interpolation"):
        return None
    if "mean" in cfg:
        data.mean, data.std = tuple(cfg["mean"]), tuple(cfg["std"])
        if hasattr(data, "mean_arg"):  # folder datasets that would otherwise compute their own statistics
            data.mean_arg, data.std_arg = data.mean, data.std
    data.interpolation = cfg.get("interpolation", data.interpolation)
    stats = f"mean {data.mean}, std {data.std}" if "mean" in cfg else "the data module's mean/std"
    return f"inputs normalised with {stats}, resize interpolation {data.interpolation}: from {cfg['source']}"
