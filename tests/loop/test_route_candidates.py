"""The candidates of issue 42 for the rest of the stacked round's distance to its bound (options of the routes bench,
measured on a GPU in one call) equal the sequential runner on a CPU."""

import pytest
import torch
from test_runner_routes import _state, _trained
from test_runner_stacked import _close, _frozen_cnn
from torch import nn

from fedlight.lab.benchmarks import route_candidates as rc


def _candidate(name, candidate, rounds=2, **kw):
    from fedtest import contract_loop

    loop = contract_loop(name, rounds=rounds, model=_frozen_cnn(), client_parallelism="vmap", **kw)
    rc.swap(loop, candidate, bmm_from=1)  # every convolution of the tiny CNN
    return loop, [loop.run_round(r)["train_loss"] for r in range(rounds)]


@pytest.mark.parametrize("candidate", ["bmm", "halves"])
def test_candidates_equal_sequential_in_float64(candidate, monkeypatch):
    """FedSAM (two forward-backward passes a step, per-client norms): each candidate against sequential training."""
    name = "fedsam"
    calls = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: calls.append(a.shape) or bmm(a, b))
    seq, rows_s = _trained(name, precision="64-true", model=_frozen_cnn(), client_parallelism="sequential")
    loop, rows_c = _candidate(name, candidate, precision="64-true")
    assert loop.runner.description.startswith("stacked, eager, ") and not loop.runner.fallbacks
    assert (len(calls) > 0) == (candidate == "bmm")  # the matmul route really ran (and only there)
    _close(_state(seq), _state(loop), "state", tol=1e-10)
    assert rows_c == pytest.approx(rows_s, abs=1e-10)


def test_bmm_candidate_compiled_in_float32():
    torch._dynamo.reset()
    seq, rows_s = _trained("fedavg", model=_frozen_cnn(), client_parallelism="sequential")
    loop, rows_c = _candidate("fedavg", "bmm", compile="aot_eager")
    assert loop.runner.description == "stacked, compiled, bmm from 1 channels" and not loop.runner.fallbacks
    _close(_state(seq), _state(loop), "state", tol=1e-5)


def test_bmm_rule_matches_the_grouped_convolution_with_stride_bias_and_autocast():
    from torch.func import vmap

    x, w, b = torch.randn(3, 2, 4, 7, 7, dtype=torch.float64), torch.randn(3, 5, 4, 3, 3, dtype=torch.float64), \
        torch.randn(3, 5, dtype=torch.float64)
    mine = vmap(lambda a, c, d: rc.stacked_conv2d_bmm(a, c, d, [2, 2], [1, 1], [1, 1], 1))(x, w, b)
    ref = torch.stack([nn.functional.conv2d(x[i], w[i], b[i], 2, 1) for i in range(3)])
    torch.testing.assert_close(mine, ref, rtol=0, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = vmap(lambda a, c: rc.stacked_conv2d_bmm(a, c, None, [1, 1], [1, 1], [1, 1], 1))(x.float(), w.float())
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("stride", [1, 2])
def test_triton_grouped_weight_gradient_equals_autograd_in_the_interpreter(stride, monkeypatch):
    """The Triton candidate (issue 42), run by Triton's interpreter on the CPU: the grouped convolution's weight
    gradient of 2 clients, 3×3, padded, odd sizes (masked tails in every block)."""
    import importlib
    import sys

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sys.modules.pop("fedlight.lab.benchmarks.triton_wgrad", None)
    tw = importlib.import_module("fedlight.lab.benchmarks.triton_wgrad")
    g = torch.Generator().manual_seed(0)
    xg = torch.randn(3, 2 * 5, 7, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2 * 6, 5, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = nn.functional.conv2d(xg, w, None, stride, 1, 1, 2)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    ref, = torch.autograd.grad(y, w, gy)
    mine = tw.grouped_wgrad(xg.detach().float(), gy.float(), 2, stride=stride, blocks=(16, 16, 16))
    torch.testing.assert_close(mine.double(), ref, rtol=0, atol=1e-4 * ref.abs().max().item())
    sys.modules.pop("fedlight.lab.benchmarks.triton_wgrad", None)  # compiled for real next time it is imported
