"""``loop.matmul_convs`` (issue 57): stacked convolutions of few input channels as unfold + one batched matmul
(:mod:`fedlight.runners.matmul_conv`) equal vmap's grouped convolution to rounding, forward and gradients, and a
stacked run with them equals the same run without."""

from __future__ import annotations

import pytest
import torch
from fedtest import DEVICES, make_loop
from torch import nn
from torch.func import functional_call, vmap

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.errors import ConfigError
from fedlight.models import LeNet5, SmallCNN
from fedlight.runners import matmul_conv
from fedlight.runners.forward import conv_forwards


@pytest.mark.parametrize("kw", [dict(kernel_size=5), dict(kernel_size=3, padding=1, bias=False),
                                dict(kernel_size=3, stride=2, padding=2, dilation=2), dict(kernel_size=(3, 1))])
def test_the_matmul_convolution_is_the_grouped_one_forward_and_backward(kw):
    """5 clients' weights, vmap over them: outputs and weight/bias gradients equal vmap's conv2d in float64."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 6, **kw).double()
    C = 5
    params = {k: (v.detach().expand(C, *v.shape) + 0.1 * torch.randn(C, *v.shape, dtype=torch.float64))
              .requires_grad_(True) for k, v in conv.named_parameters()}
    x = torch.randn(C, 4, 3, 11, 9, dtype=torch.float64)
    gy = None
    got = []
    for swap in (False, True):
        with conv_forwards([conv] if swap else [], matmul_conv.conv_as_matmul):
            y = vmap(lambda p, xc: functional_call(conv, p, (xc,)))(params, x)
        gy = torch.randn_like(y) if gy is None else gy
        got.append((y, torch.autograd.grad(y, list(params.values()), gy)))
    (y0, g0), (y1, g1) = got
    assert y0.shape == y1.shape and y1.is_contiguous()
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_which_convolutions_are_selected():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Conv2d(3, 6, 3, groups=3),
                          nn.Conv2d(3, 4, 3, padding="same"), nn.Conv2d(2, 4, 3, padding_mode="reflect"))
    assert matmul_conv.select(model, 3) == ["0"]
    assert matmul_conv.selected(model) == [model[0]]
    assert matmul_conv.select(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)), 8) == ["0", "1"]
    with pytest.raises(ConfigError, match="loop.matmul_convs` is a number of input channels"):
        LoopConfig(matmul_convs=-1)


def _rgb_clients(n_clients=4, n=12, seed=0, size=8):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_clients):
        y = torch.randint(0, 3, (n,), generator=g)
        out.append((torch.randn(n, 3, size, size, generator=g) + y.view(-1, 1, 1, 1) * 0.5 + 0.1 * i, y))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule,channels", [("fedavg", 3), ("fednsam", 3), ("scaffold", 8)])
def test_a_stacked_run_with_matmul_convs_equals_it_without(rule, channels, device, capsys):
    """3 rounds, 4 clients, 3 a round, K = 3, BatchNorm, 64-true: the first convolution (3 channels) or both (8) as
    matmuls; every global parameter and buffer within 1e-12 of the grouped-convolution run, on each device."""
    finals = []
    for n in (0, channels):
        torch.manual_seed(0)
        model = SmallCNN(in_channels=3, num_classes=3, width=4, norm="batch")
        loop = make_loop(fedlight.create(rule), _rgb_clients(), model, rounds=3, local_steps=3, lr=0.05,
                         clients_per_round=3, batch_size=4, accelerator=device, client_parallelism="vmap",
                         matmul_convs=n)
        assert len(loop.runner.forward.matmul_convs) == (0 if n == 0 else 1 if n == 3 else 2)
        for r in range(3):
            loop.run_round(r)
        finals.append({**loop.state.params, **loop.state.buffers})
    assert "loop.matmul_convs" in capsys.readouterr().err
    for k in finals[0]:
        torch.testing.assert_close(finals[1][k], finals[0][k], rtol=1e-12, atol=1e-12, msg=k)


def test_under_autocast_it_leaves_in_the_batched_convolutions_dtype_and_compiles():
    """Under bf16 autocast and vmap the matmul convolution returns the dtype vmap's batched conv2d returns on this
    device (float32 on a CPU), equal to it to bf16 rounding, and the same through ``torch.compile`` (aot_eager)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, 5)
    C = 3
    params = {k: v.detach().expand(C, *v.shape).clone() for k, v in conv.named_parameters()}
    x = torch.randn(C, 2, 3, 12, 12)

    def stacked(p, xs):
        return vmap(lambda pc, xc: functional_call(conv, pc, (xc,)))(p, xs)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = stacked(params, x)
        with conv_forwards([conv], matmul_conv.conv_as_matmul):
            got = stacked(params, x)
            compiled = torch.compile(stacked, backend="aot_eager")(params, x)
    assert got.dtype == want.dtype == (torch.bfloat16 if matmul_conv.batched_conv_autocasts("cpu", torch.bfloat16)
                                       else torch.float32)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compiled, got, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_stacked_run_with_matmul_convs_stays_stacked_and_close(device):
    """bf16-mixed, LeNet-5 (conv1 → ReLU → pool → conv2): the matmul's output meets the next (grouped, batched)
    convolution in the dtype it expects, so the run trains stacked without a fallback, close to the run without (bf16
    rounding, 2 rounds)."""
    finals = []
    for n in (0, 3):
        torch.manual_seed(0)
        model = LeNet5(num_classes=3, input_size=16)
        loop = make_loop(fedlight.create("fedavg"), _rgb_clients(size=16), model, rounds=2, local_steps=3, lr=0.05,
                         clients_per_round=3, batch_size=4, precision="bf16-mixed", client_parallelism="vmap",
                         matmul_convs=n, accelerator=device)
        for r in range(2):
            loop.run_round(r)
        assert loop.runner.fallbacks == [] and loop.runner.sequential is None
        finals.append(loop.state.params)
    for k in finals[0]:
        torch.testing.assert_close(finals[1][k], finals[0][k], rtol=3e-2, atol=3e-2, msg=k)


def test_a_model_reused_by_a_later_run_keeps_no_earlier_choice():
    """One model object through two loops, the first with ``loop.matmul_convs 3``, the second without: the second's
    stacked forward convolves as vmap's grouped convolution (no mark, no cached forward of the first)."""
    torch.manual_seed(0)
    model = SmallCNN(in_channels=3, num_classes=3, width=4, norm="batch")
    forwards = []
    for n in (3, 0, 3):
        loop = make_loop(fedlight.create("fedavg"), _rgb_clients(), model, rounds=1, local_steps=1,
                         clients_per_round=3, batch_size=4, client_parallelism="vmap", matmul_convs=n)
        forwards.append(loop.runner.forward)
    assert [len(f.matmul_convs) for f in forwards] == [1, 0, 1]
    assert forwards[0] is forwards[2] and forwards[1] is not forwards[0]  # compiled code reused per selection
    assert len(matmul_conv.selected(model)) == 1
