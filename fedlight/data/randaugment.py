"""RandAugment as batched tensor ops on the device, seeded per client like :class:`~fedlight.data.augment.CropFlip`.

Each image gets ``num_ops`` operations in turn; for every one, the op, whether it is applied (probability
``prob``), its magnitude (``magnitude`` on a 0–10 scale plus Gaussian noise of std ``magnitude_std``, clipped to
[0, 10]) and its sign are drawn on CPU from the caller's ``torch.Generator`` by :meth:`RandAugment.sample`.
:meth:`RandAugment.apply` then runs, per operation, stages that each handle the images whose op they hold: an
affine warp (rotate, shear, translate), a per-image, per-channel 256-entry lookup table (auto-contrast, equalize,
solarize, posterize, contrast, brightness) and blends with a degenerate image (color, sharpness). On an accelerator
every stage runs on the whole batch and a mask picks the results, so the host never waits for the device; on CPU
each stage runs on its own images only.

Images are uint8 (or float holding integer values 0–255); every op rounds and clamps to 0–255, as an 8-bit
image library would. Magnitude f = M/10 maps to an op argument (stronger as M grows; signed ops get a random
sign s = ±1): rotate 30·s·f degrees, shear 0.3·s·f, translate 0.45·s·f of the side, enhance factor 1 + 0.9·s·f,
solarize threshold 256 − ⌊256 f⌋, posterize to 8 − ⌊4 f⌋ bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fedlight.errors import check

OPS = (
    "identity", "autocontrast", "equalize", "rotate", "solarize", "color", "posterize",
    "contrast", "brightness", "sharpness", "shear_x", "shear_y", "translate_x", "translate_y",
)
"""RandAugment's operations; an op's id is its index here."""

IDENTITY, AUTOCONTRAST, EQUALIZE, ROTATE, SOLARIZE, COLOR, POSTERIZE = range(7)
CONTRAST, BRIGHTNESS, SHARPNESS, SHEAR_X, SHEAR_Y, TRANSLATE_X, TRANSLATE_Y = range(7, 14)
LEVEL_SCALE = 10_000
"""Signed magnitudes are stored as integers in units of 1/LEVEL_SCALE, so all parameters stay int64."""
LUMA = (0.299, 0.587, 0.114)


def _is(op: Tensor, *ids: int) -> Tensor:
    """Boolean ``[B]``: the op of each image is one of ``ids`` (comparisons with Python numbers: no host-to-device
    copy, which would wait for the device)."""
    mask = op == ids[0]
    for i in ids[1:]:
        mask = mask | (op == i)
    return mask


def _settle(x: Tensor) -> Tensor:
    """Round to the nearest integer and clamp to 0–255 (every op ends with this)."""
    return x.round().clamp_(0, 255)


# ---------------------------------------------------------------------------------------------- affine warps
def warp(x: Tensor, op: Tensor, arg: Tensor, fill: float = 128.0) -> Tensor:
    """Rotate / shear / translate each image about its centre (bilinear; uncovered pixels get ``fill``).

    Per image ``b``: ``op[b]`` ROTATE turns the content counter-clockwise by ``arg[b]`` degrees, SHEAR_X samples
    column ``j + arg[b]·(i − c)`` for output pixel ``(i, j)``, SHEAR_Y row ``i + arg[b]·(j − c)``, TRANSLATE_X /
    TRANSLATE_Y move the content right / down by ``arg[b]`` pixels; any other op gives the identity warp.
    ``x`` is float ``[B, C, H, W]`` with integer values; the result is rounded.
    """
    b, _, h, w = x.shape
    rad = torch.where(op == ROTATE, arg, 0.0) * (math.pi / 180)
    cos, sin = rad.cos(), rad.sin()
    shx, shy = torch.where(op == SHEAR_X, arg, 0.0), torch.where(op == SHEAR_Y, arg, 0.0)
    tx, ty = -torch.where(op == TRANSLATE_X, arg, 0.0), -torch.where(op == TRANSLATE_Y, arg, 0.0)
    # output -> input in centred pixel coordinates (x = column, y = row, y pointing down) ...
    a, bb, c, d = cos, -sin + shx, sin + shy, cos
    # ... and in grid_sample's normalised coordinates (align_corners=False: u = 2·x / W)
    theta = torch.stack([torch.stack([a, bb * (h / w), 2 * tx / w], 1),
                         torch.stack([c * (w / h), d, 2 * ty / h], 1)], 1)
    grid = F.affine_grid(theta.to(x.dtype), [b, 1, h, w], align_corners=False)
    return _settle(F.grid_sample(x - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + fill)


# ---------------------------------------------------------------------------------------------- lookup tables
def histogram(x: Tensor) -> Tensor:
    """Per image and channel counts of each value 0–255: ``[B, C, 256]`` (float)."""
    b, c = x.shape[:2]
    idx = x.reshape(b * c, -1).long()
    return torch.zeros(b * c, 256, device=x.device).scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32)
                                                                 ).view(b, c, 256)


def _autocontrast_lut(hist: Tensor, v: Tensor) -> Tensor:
    """Stretch each channel's [min, max] to [0, 255] (truncating); a constant channel is left as it is."""
    present = hist > 0
    lo = present.float().argmax(-1, keepdim=True).float()
    hi = 255 - present.flip(-1).float().argmax(-1, keepdim=True).float()
    scale = 255 / (hi - lo).clamp_min(1)
    lut = ((v - lo) * scale).floor().clamp(0, 255)
    return torch.where(hi > lo, lut, v)


def _equalize_lut(hist: Tensor, v: Tensor) -> Tensor:
    """Histogram equalisation per channel: ``step = (n − count of the top value) // 255``, value ``i`` maps to
    ``(step // 2 + number of pixels below i) // step`` (at most 255); identity when ``step`` is 0."""
    top = 255 - (hist > 0).flip(-1).float().argmax(-1, keepdim=True)
    step = torch.div(hist.sum(-1, keepdim=True) - hist.gather(-1, top), 255, rounding_mode="floor")
    below = hist.cumsum(-1) - hist
    lut = torch.div(torch.div(step, 2, rounding_mode="floor") + below, step.clamp_min(1), rounding_mode="floor")
    return torch.where(step > 0, lut.clamp(max=255), v)


def _luma_mean(hist: Tensor) -> Tensor:
    """Mean brightness of each image, rounded: ``[B, 1, 1]``."""
    v = torch.arange(256, device=hist.device, dtype=hist.dtype)
    means = (hist * v).sum(-1) / hist.sum(-1).clamp_min(1)  # [B, C]
    luma = means[:, 0] if means.shape[1] != 3 else sum(w * means[:, k] for k, w in enumerate(LUMA))
    return luma.round()[:, None, None]


def lookup(x: Tensor, op: Tensor, arg: Tensor) -> Tensor:
    """Apply the per-pixel ops through one ``[B, C, 256]`` lookup table per image.

    AUTOCONTRAST; EQUALIZE; SOLARIZE inverts values ``>= arg``; POSTERIZE keeps the top ``arg`` bits;
    BRIGHTNESS multiplies by ``arg``; CONTRAST moves each value to ``m + arg·(v − m)`` with ``m`` the image's
    rounded mean luma; any other op: identity. Results are rounded and clamped.
    """
    b, c = x.shape[:2]
    hist = histogram(x)
    v = torch.arange(256, device=x.device, dtype=torch.float32).expand(b, c, 256)
    a = arg.float()[:, None, None]
    drop = 2 ** (8 - a.clamp(0, 8))
    mean = _luma_mean(hist)
    cases = [(AUTOCONTRAST, _autocontrast_lut(hist, v)), (EQUALIZE, _equalize_lut(hist, v)),
             (SOLARIZE, torch.where(v >= a, 255 - v, v)), (POSTERIZE, torch.floor(v / drop) * drop),
             (BRIGHTNESS, _settle(v * a)), (CONTRAST, _settle(mean + a * (v - mean)))]
    lut = v
    for kind, table in cases:
        lut = torch.where((op == kind)[:, None, None], table, lut)
    return lut.gather(2, x.reshape(b, c, -1).long()).view_as(x)


# ---------------------------------------------------------------------------------------------- blends
def _gray(x: Tensor) -> Tensor:
    if x.shape[1] != 3:
        return x
    return _settle(sum(w * x[:, k:k + 1] for k, w in enumerate(LUMA)))


def _smooth(x: Tensor) -> Tensor:
    """The 3×3 smoothing filter (centre 5, neighbours 1, /13) inside the image, rounded; the border unchanged."""
    h, w = x.shape[2:]
    if h < 3 or w < 3:
        return x
    rows = x[:, :, :-2] + x[:, :, 1:-1] + x[:, :, 2:]
    box = rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:]  # 3×3 sums, exact on integer values
    inner = _settle((box + 4 * x[:, :, 1:-1, 1:-1]) / 13)
    out = x.clone()
    out[:, :, 1:-1, 1:-1] = inner
    return out


def color(x: Tensor, arg: Tensor) -> Tensor:
    """``g + arg·(x − g)`` per image, with ``g`` the rounded luma image; rounded and clamped."""
    g = _gray(x)
    return _settle(g + arg.to(x.dtype)[:, None, None, None] * (x - g))


def sharpness(x: Tensor, arg: Tensor) -> Tensor:
    """``s + arg·(x − s)`` per image, with ``s`` the smoothed image; rounded and clamped."""
    s = _smooth(x)
    return _settle(s + arg.to(x.dtype)[:, None, None, None] * (x - s))


# ---------------------------------------------------------------------------------------------- one op per image
def _where_op(x: Tensor, op: Tensor, ids: tuple[int, ...], fn, masked: bool) -> Tensor:
    """``fn(rows)`` (the stage applied to ``x[rows]``) for the images whose op is in ``ids``, the others unchanged.

    ``masked``: compute all images and pick with a mask, so the host never waits for the device to learn which
    images those are (for accelerators); else compute only those images (for CPU).
    """
    mask = _is(op, *ids)
    if masked:
        return torch.where(mask[:, None, None, None], fn(slice(None)), x)
    idx = mask.nonzero().squeeze(1)
    return x if idx.numel() == 0 else x.index_copy(0, idx, fn(idx))


GEOMETRIC = (ROTATE, SHEAR_X, SHEAR_Y, TRANSLATE_X, TRANSLATE_Y)
PIXEL = (AUTOCONTRAST, EQUALIZE, SOLARIZE, POSTERIZE, BRIGHTNESS, CONTRAST)


def _run(x: Tensor, op: Tensor, arg: Tensor, fill: float, masked: bool | None = None) -> Tensor:
    """Apply each image's op ``op[b]`` with argument ``arg[b]``: warps, lookup tables, color, sharpness in turn (each
    image's op belongs to exactly one of them). ``masked``: see :func:`_where_op` (default: unless on CPU)."""
    masked = x.device.type != "cpu" if masked is None else masked
    x = _where_op(x, op, GEOMETRIC, lambda i: warp(x[i], op[i], arg[i], fill), masked)
    x = _where_op(x, op, PIXEL, lambda i: lookup(x[i], op[i], arg[i]), masked)
    x = _where_op(x, op, (COLOR,), lambda i: color(x[i], arg[i]), masked)
    return _where_op(x, op, (SHARPNESS,), lambda i: sharpness(x[i], arg[i]), masked)


def apply_op(x: Tensor, name: str, arg: float | Tensor = 0.0, fill: float = 128.0) -> Tensor:
    """Apply the op ``name`` (one of :data:`OPS`) with the argument ``arg`` (a number or one per image) to every
    image of ``x`` ``[B, C, H, W]``; returns a tensor of ``x``'s dtype. The argument is the op's own unit:
    degrees, shear factor, pixels, threshold, bits or enhance factor."""
    check(name in OPS, f"unknown RandAugment op {name!r}; choose from {', '.join(OPS)}")
    b = x.shape[0]
    op = torch.full((b,), OPS.index(name), device=x.device)
    arg = torch.as_tensor(arg, dtype=torch.float32, device=x.device).expand(b)
    out = _run(x.float(), op, arg, fill)
    return out.to(x.dtype)


def op_arguments(op: Tensor, level: Tensor, height: int, width: int) -> Tensor:
    """Each image's op argument from its signed magnitude ``level`` in [−1, 1] (sign ignored by unsigned ops)."""
    f = level.abs()
    enhance, side = 1 + 0.9 * level, torch.where(op == TRANSLATE_X, width, height)
    cases = [((ROTATE,), 30 * level), ((SHEAR_X, SHEAR_Y), 0.3 * level),
             ((TRANSLATE_X, TRANSLATE_Y), 0.45 * level * side),
             ((SOLARIZE,), 256 - torch.floor(256 * f)), ((POSTERIZE,), 8 - torch.floor(4 * f)),
             ((COLOR, CONTRAST, BRIGHTNESS, SHARPNESS), enhance)]
    arg = torch.zeros_like(level)
    for kinds, value in cases:
        arg = torch.where(_is(op, *kinds), value, arg)
    return arg


@dataclass(frozen=True)
class RandAugment:
    """RandAugment (Cubuk et al., 2020), batched on the device; parameters drawn up front from a generator.

    The defaults are timm's ``rand-m9-mstd0.5`` convention (two ops per image, magnitude 9 of 10 with noise of
    std 0.5, each op applied with probability 1/2) over the 14 ops of the original paper's list (:data:`OPS`);
    magnitudes grow stronger with M for every op (see the module docstring for the mapping).

    Args:
        num_ops: Operations per image (N).
        magnitude: Magnitude M on a 0–10 scale.
        magnitude_std: Std of Gaussian noise added to M for every op of every image (0: none).
        prob: Probability that a drawn op is applied (else the image passes unchanged for that op).
        fill: Pixel value (0–255) for the area a rotation, shear or translation uncovers.
        ops: Names of the ops to draw from (a subset of :data:`OPS`).
    """

    num_ops: int = 2
    magnitude: float = 9.0
    magnitude_std: float = 0.5
    prob: float = 0.5
    fill: float = 128.0
    ops: tuple[str, ...] = OPS

    def __post_init__(self) -> None:
        check(isinstance(self.num_ops, int) and self.num_ops >= 1,
              f"`data.randaugment.num_ops` must be a positive integer, got {self.num_ops!r}")
        check(0 <= self.magnitude <= 10, f"`data.randaugment.magnitude` must be in [0, 10], got {self.magnitude!r}")
        check(self.magnitude_std >= 0, f"`data.randaugment.magnitude_std` must be >= 0, got {self.magnitude_std!r}")
        check(0 <= self.prob <= 1, f"`data.randaugment.prob` must be in [0, 1], got {self.prob!r}")
        check(0 <= self.fill <= 255, f"`data.randaugment.fill` must be a pixel value in [0, 255], got {self.fill!r}")
        bad = [o for o in self.ops if o not in OPS]
        check(len(self.ops) > 0 and not bad,
              f"`data.randaugment.ops` {bad or '[]'} are not ops; choose from {', '.join(OPS)}")

    @property
    def param_width(self) -> int:
        """Columns of :meth:`sample`'s result."""
        return 2 * self.num_ops

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        """Draw parameters for ``n`` images on CPU: int64 ``[n, 2·num_ops]``, per op (id, signed level·10⁴)."""
        shape = (n, self.num_ops)
        ids = torch.tensor([OPS.index(o) for o in self.ops])
        op = ids[torch.randint(0, len(ids), shape, generator=generator)]
        applied = torch.rand(shape, generator=generator) < self.prob
        noise = torch.randn(shape, generator=generator) * self.magnitude_std
        sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
        level = (self.magnitude + noise).clamp(0, 10) / 10 * sign
        op = torch.where(applied, op, IDENTITY)
        return torch.stack([op, (level * LEVEL_SCALE).round().long()], 2).view(n, 2 * self.num_ops)

    def apply(self, x: Tensor, params: Tensor) -> Tensor:
        """Augment the batch ``x`` ``[B, C, H, W]`` with the rows of ``params`` (on ``x``'s device); same dtype."""
        out = x.float()
        for k in range(self.num_ops):
            op, level = params[:, 2 * k], params[:, 2 * k + 1].float() / LEVEL_SCALE
            out = _run(out, op, op_arguments(op, level, x.shape[2], x.shape[3]), self.fill)
        return out.to(x.dtype)
