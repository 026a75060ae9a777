"""RandAugment's batched ops against hand-derived values; parameters only from the generator; device resize."""

import pytest
import torch

from fedlight.data.augment import Chain, CropFlip, resize
from fedlight.data.randaugment import OPS, RandAugment, apply_op, op_arguments
from fedlight.errors import ConfigError


def gray(values, h=None, w=None):
    """A one-image RGB batch whose three channels all hold ``values`` (row-major ``h x w``)."""
    t = torch.tensor(values, dtype=torch.uint8)
    h = h or 1
    return t.view(1, 1, h, -1).expand(1, 3, h, t.numel() // h).contiguous()


def images(b=8, h=12, w=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, h, w), generator=g).to(torch.uint8)


# ---------------------------------------------------------------------------------------------- pixel ops
def test_solarize_inverts_values_at_or_above_the_threshold():
    out = apply_op(gray([0, 127, 128, 255]), "solarize", 128)
    assert out[0, 0, 0].tolist() == [0, 127, 127, 0] and out.dtype == torch.uint8


def test_posterize_keeps_the_top_bits():
    out = apply_op(gray([0, 63, 64, 127, 128, 200, 255]), "posterize", 2)
    assert out[0, 0, 0].tolist() == [0, 0, 64, 64, 128, 192, 192]
    assert torch.equal(apply_op(gray([3, 77, 255]), "posterize", 8), gray([3, 77, 255]))


def test_brightness_scales_and_clamps():
    assert apply_op(gray([0, 10, 100, 200]), "brightness", 1.5)[0, 0, 0].tolist() == [0, 15, 150, 255]
    assert apply_op(gray([0, 10, 100, 200]), "brightness", 0.0).sum() == 0


def test_contrast_moves_values_towards_the_mean_luma():
    # luma mean of (0, 100, 200, 100) is 100: v -> 100 + 0.5 (v - 100)
    assert apply_op(gray([0, 100, 200, 100]), "contrast", 0.5)[0, 0, 0].tolist() == [50, 100, 150, 100]


def test_autocontrast_stretches_each_channel_and_keeps_a_constant_one():
    x = torch.stack([torch.tensor([50, 100, 150]), torch.tensor([7, 7, 7]), torch.tensor([0, 255, 128])])
    out = apply_op(x.view(1, 3, 1, 3).to(torch.uint8), "autocontrast")
    assert out[0, :, 0].tolist() == [[0, 127, 255], [7, 7, 7], [0, 255, 128]]  # 127 = floor(50 * 255 / 100)


def test_equalize_spreads_the_histogram():
    # 256 pixels of 10 and 256 of 20: step = (512 - 256) // 255 = 1, so 10 -> 0 pixels below = 0, 20 -> 256 -> 255
    x = torch.tensor([10, 20]).repeat_interleave(256).view(1, 1, 16, 32).to(torch.uint8)
    out = apply_op(x, "equalize")
    assert set(out[x == 10].tolist()) == {0} and set(out[x == 20].tolist()) == {255}
    assert torch.equal(apply_op(gray([1, 2, 3]), "equalize"), gray([1, 2, 3]))  # too few pixels: step 0


def test_color_blends_with_the_luma_image():
    x = torch.tensor([100, 50, 200], dtype=torch.uint8).view(1, 3, 1, 1)  # luma 29.9 + 29.35 + 22.8 = 82.05 -> 82
    assert apply_op(x, "color", 0.0).flatten().tolist() == [82, 82, 82]
    assert apply_op(x, "color", 2.0).flatten().tolist() == [118, 18, 255]  # 82 + 2 (v - 82), clamped
    assert torch.equal(apply_op(x, "color", 1.0), x)


def test_sharpness_blends_with_the_smoothed_image_inside_the_border():
    x = torch.zeros(1, 3, 3, 3, dtype=torch.uint8)
    x[..., 1, 1] = 130  # smoothed centre: 5 * 130 / 13 = 50; the border is not filtered
    assert apply_op(x, "sharpness", 0.0)[0, 0].tolist() == [[0, 0, 0], [0, 50, 0], [0, 0, 0]]
    assert apply_op(x, "sharpness", 2.0)[0, 0, 1, 1] == 210  # 50 + 2 (130 - 50)
    assert torch.equal(apply_op(x, "sharpness", 1.0), x)


# ---------------------------------------------------------------------------------------------- geometric ops
def test_rotate_by_90_and_180_degrees_equals_rot90():
    x = images(b=3, h=9, w=9)
    assert torch.equal(apply_op(x, "rotate", 90.0), torch.rot90(x, 1, (2, 3)))  # counter-clockwise
    assert torch.equal(apply_op(x, "rotate", -90.0), torch.rot90(x, -1, (2, 3)))
    assert torch.equal(apply_op(x, "rotate", 180.0), x.flip(2, 3))
    assert torch.equal(apply_op(x, "rotate", 0.0), x)


def test_rotate_by_45_degrees_fills_the_corners():
    out = apply_op(torch.full((1, 3, 16, 16), 200, dtype=torch.uint8), "rotate", 45.0, fill=128)
    assert out[0, 0, 0, 0] == 128 and out[0, 0, 8, 8] == 200


def test_translate_moves_the_content_and_fills_the_rest():
    x = images(b=2, h=6, w=7)
    right = apply_op(x, "translate_x", 2.0, fill=9)
    assert torch.equal(right[..., 2:], x[..., :-2]) and (right[..., :2] == 9).all()
    up = apply_op(x, "translate_y", -1.0, fill=9)
    assert torch.equal(up[..., :-1, :], x[..., 1:, :]) and (up[..., -1, :] == 9).all()


def test_shear_x_shifts_each_row_by_its_distance_from_the_centre():
    x = images(b=1, h=5, w=8)
    out = apply_op(x, "shear_x", 0.5, fill=0)  # output (i, j) samples column j + 0.5 (i - 2)
    assert torch.equal(out[..., 2, :], x[..., 2, :])
    assert torch.equal(out[..., 0, 1:], x[..., 0, :-1]) and (out[..., 0, 0] == 0).all()
    assert torch.equal(out[..., 4, :-1], x[..., 4, 1:]) and (out[..., 4, -1] == 0).all()
    assert torch.equal(apply_op(x.transpose(2, 3), "shear_y", 0.5, fill=0), out.transpose(2, 3))


def test_every_op_keeps_shape_dtype_and_range():
    x = images(b=4, h=10, w=14)
    for name in OPS:
        out = apply_op(x.float(), name, 0.7 if name not in ("solarize", "posterize") else 100)
        assert out.shape == x.shape and out.dtype == torch.float32, name
        assert out.min() >= 0 and out.max() <= 255 and torch.equal(out, out.round()), name
    assert torch.equal(apply_op(x, "identity"), x)


# ---------------------------------------------------------------------------------------------- RandAugment
def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_parameters_come_only_from_the_generator():
    ra, x = RandAugment(), images(b=16)
    state = torch.random.get_rng_state()
    p1, p2 = ra.sample(16, gen(5)), ra.sample(16, gen(5))
    assert torch.equal(p1, p2) and p1.shape == (16, 4) and p1.dtype == torch.int64
    assert torch.equal(ra.apply(x, p1), ra.apply(x, p1))  # nothing random in apply
    assert torch.equal(torch.random.get_rng_state(), state)  # torch's global stream untouched
    assert not torch.equal(ra.sample(16, gen(6)), p1)


def test_one_call_equals_a_call_per_chunk():
    ra, x = RandAugment(prob=1.0), images(b=24, seed=3)
    p = ra.sample(24, gen(1))
    chunks = torch.cat([ra.apply(x[a:a + 5], p[a:a + 5]) for a in range(0, 24, 5)])
    assert torch.equal(ra.apply(x, p), chunks)


def test_batched_equals_each_images_ops_in_turn():
    ra, x = RandAugment(num_ops=3, prob=1.0), images(b=40, h=10, w=10, seed=4)
    p = ra.sample(40, gen(2))
    out = ra.apply(x, p)
    for b in range(40):
        want = x[b:b + 1]
        for k in range(3):
            op, level = p[b:b + 1, 2 * k], p[b:b + 1, 2 * k + 1].float() / 10_000
            want = apply_op(want, OPS[op.item()], op_arguments(op, level, 10, 10), fill=ra.fill)
        assert torch.equal(out[b:b + 1], want), (b, [OPS[i] for i in p[b, ::2].tolist()])


def test_op_choice_magnitude_and_probability():
    p = RandAugment(prob=1.0).sample(14_000, gen(0))
    counts = torch.bincount(p[:, ::2].flatten(), minlength=14)
    assert counts.min() > 1700 and counts.max() < 2300  # uniform over 14 ops: 2000 each
    level = p[:, 1::2].abs().float() / 10_000
    assert level.max() <= 1.0 and abs(level.mean().item() - 0.9) < 0.01  # M = 9 of 10, std 0.5, clipped at 10
    half = RandAugment(prob=0.5).sample(10_000, gen(0))[:, ::2]
    assert abs((half == 0).float().mean().item() - (0.5 + 0.5 / 14)) < 0.02  # skipped, or identity drawn
    x = images(b=8)
    assert torch.equal(RandAugment(prob=0.0).apply(x, RandAugment(prob=0.0).sample(8, gen(1))), x)


def test_op_arguments_follow_the_magnitude():
    names = ["rotate", "shear_x", "translate_x", "translate_y", "solarize", "posterize", "brightness", "solarize"]
    op = torch.tensor([OPS.index(n) for n in names])
    level = torch.tensor([0.9, -0.5, 0.5, 0.5, 0.9, 0.9, -0.9, 0.0])
    args = op_arguments(op, level, height=20, width=40).tolist()
    want = [27.0, -0.15, 9.0, 4.5, 26.0, 5.0, 0.19, 256.0]
    assert args == pytest.approx(want, abs=1e-5)


def test_subset_of_ops_and_bad_settings():
    p = RandAugment(ops=("rotate", "equalize"), prob=1.0).sample(200, gen(0))
    assert set(p[:, ::2].flatten().tolist()) == {OPS.index("rotate"), OPS.index("equalize")}
    for kw, field in [({"num_ops": 0}, "num_ops"), ({"magnitude": 11}, "magnitude"), ({"prob": 2}, "prob"),
                      ({"ops": ("blur",)}, "ops"), ({"fill": 300}, "fill")]:
        with pytest.raises(ConfigError, match=f"randaugment.{field}"):
            RandAugment(**kw)


def test_chain_gives_each_step_its_columns():
    crop, ra = CropFlip(pad=2), RandAugment(prob=1.0)
    chain, x = Chain((crop, ra)), images(b=6)
    p = chain.sample(6, gen(3))
    g = gen(3)
    assert chain.param_width == 7 and torch.equal(p, torch.cat([crop.sample(6, g), ra.sample(6, g)], 1))
    assert torch.equal(chain.apply(x, p), ra.apply(crop.apply(x, p[:, :3]), p[:, 3:]))


# ---------------------------------------------------------------------------------------------- resize
def test_resize_is_bilinear_and_keeps_uint8():
    x = torch.tensor([0, 255], dtype=torch.uint8).view(1, 1, 1, 2).expand(1, 3, 2, 2)
    out = resize(x, 4)  # source columns -0.25, 0.25, 0.75, 1.25 -> 0, 63.75, 191.25, 255
    assert out.dtype == torch.uint8 and out[0, 0, 0].tolist() == [0, 64, 191, 255]
    same = images(b=1, h=4, w=4)
    assert resize(same, 4) is same
    assert torch.equal(resize(torch.full((2, 3, 32, 32), 77, dtype=torch.uint8), 224), torch.full((2, 3, 224, 224), 77,
                                                                                                    dtype=torch.uint8))


def test_masked_path_for_accelerators_equals_the_subset_path():
    from fedlight.data.randaugment import _run

    x = images(b=30, h=9, w=11, seed=5).float()
    op = torch.arange(30) % 14
    arg = op_arguments(op, torch.linspace(-1, 1, 30), 9, 11)
    assert torch.equal(_run(x, op, arg, 128.0, masked=True), _run(x, op, arg, 128.0, masked=False))
