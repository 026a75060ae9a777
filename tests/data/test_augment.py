"""Batched crop-with-padding and flip: identity, flip, zero-filled shift, equivalence to pad-then-crop."""

import torch
import torch.nn.functional as F

from fedlight.data.augment import CropFlip, crop_flip


def images(b=6, c=3, h=8, w=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (b, c, h, w), generator=g, dtype=torch.int64).to(torch.uint8)


def zeros(b):
    return torch.zeros(b, dtype=torch.int64)


def test_zero_shift_no_flip_is_identity():
    x = images()
    out = crop_flip(x, zeros(6), zeros(6), torch.zeros(6, dtype=torch.bool))
    assert out.dtype == torch.uint8 and torch.equal(out, x)


def test_flip_mirrors_left_right():
    x = images()
    out = crop_flip(x, zeros(6), zeros(6), torch.ones(6, dtype=torch.bool))
    assert torch.equal(out, x.flip(-1))


def test_shift_is_translation_with_zero_fill():
    x = images(b=1)
    out = crop_flip(x, torch.tensor([2]), torch.tensor([-3]), torch.tensor([False]))
    # out[i, j] = x[i + 2, j - 3]: rows shift up by 2, columns right by 3; the rest is black
    assert torch.equal(out[0, :, :-2, 3:], x[0, :, 2:, :-3])
    assert (out[0, :, -2:, :] == 0).all() and (out[0, :, :, :3] == 0).all()


def test_equals_pad_then_crop_then_flip_per_sample():
    pad, x = 4, images(b=16, h=12, w=12, seed=1)
    aug = CropFlip(pad=pad, flip=True)
    params = aug.sample(16, torch.Generator().manual_seed(3))
    out = aug.apply(x, params)
    padded = F.pad(x, (pad,) * 4)  # torchvision RandomCrop(padding=4): zero fill in raw pixel space
    for i, (sy, sx, fl) in enumerate(params.tolist()):
        oy, ox = sy + pad, sx + pad
        ref = padded[i, :, oy : oy + 12, ox : ox + 12]
        assert torch.equal(out[i], ref.flip(-1) if fl else ref)


def test_sample_ranges_and_determinism():
    aug = CropFlip(pad=4)
    a = aug.sample(1000, torch.Generator().manual_seed(0))
    b = aug.sample(1000, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (1000, 3) and a.dtype == torch.int64
    assert a[:, :2].min() == -4 and a[:, :2].max() == 4
    assert set(a[:, 2].tolist()) == {0, 1}
    assert (CropFlip(pad=2, flip=False).sample(100, torch.Generator())[:, 2] == 0).all()
