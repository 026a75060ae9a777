"""The routes past the grouped convolution (issue 31): clients on streams and the channels-last stacked route equal
the sequential runner; ``auto`` reads its table of measured routes."""

from types import SimpleNamespace

import pytest
import torch
from fedtest import contract_loop, image_clients, make_loop, tiny_cnn
from test_runner_stacked import _close, _frozen_cnn
from torch import nn

import fedlight
from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig
from fedlight.core.rules import LocalUpdateRule
from fedlight.runners import SequentialRunner, StackedRunner, StreamsRunner, TrainSetup, choice, nhwc, select_runner
from fedlight.runners.nhwc import ChannelsLastStackedRunner, stacked_conv2d


def _state(loop):
    return loop.x, loop.buffers, loop.server.state_dict(), loop.store.state_dict()


def _trained(name, rounds=2, **kw):
    loop = contract_loop(name, **kw)
    rows = [loop.run_round(r)["train_loss"] for r in range(rounds)]
    return loop, rows


# ------------------------------------------------------------------------------------------------ streams
@pytest.mark.parametrize("precision", ["32-true", "64-true"])
@pytest.mark.parametrize("name", ["fedavg", "scaffold", "fedsam", "fedwmsam"])
def test_streams_equal_sequential_bitwise(name, precision):
    """Every client runs the sequential runner's own steps on its own model copy: the same bits, not just close."""
    seq, rows_s = _trained(name, precision=precision, client_parallelism="sequential")
    par, rows_p = _trained(name, precision=precision, client_parallelism="streams")
    assert isinstance(par.runner, StreamsRunner) and len(par.runner.slots) == 3  # 3 clients per round, 3 copies
    assert rows_p == rows_s
    _close(_state(seq), _state(par), "state", tol=0.0)


def test_compiled_streams_equal_compiled_sequential_and_each_copy_trains_its_own_parameters():
    """Each copy is compiled on its own (the later ones copied from the run's model after it was compiled): a copy's
    compiled forward must read that copy's parameters, or the round would not equal the compiled sequential one."""
    torch._dynamo.reset()
    seq, rows_s = _trained("fedsam", client_parallelism="sequential", compile="aot_eager", vmap_chunk=2)
    par, rows_p = _trained("fedsam", client_parallelism="streams", compile="aot_eager", vmap_chunk=2)
    assert par.runner.description == "streams, compiled (no streams on CPU)" and len(par.runner.slots) == 2
    assert rows_p == pytest.approx(rows_s, abs=1e-6)
    _close(_state(seq), _state(par), "state", tol=1e-6)


def test_streams_in_chunks_with_dropout_keep_each_clients_random_masks():
    """Steps of different clients interleave; each client's generator state travels with it, so dropout draws the
    masks sequential training draws (without that, client 2's first step would take client 1's stream)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))

    out = {}
    for mode, chunk in (("sequential", None), ("streams", None), ("streams", 2)):
        loop = contract_loop("fedavg", model=model(), client_parallelism=mode, vmap_chunk=chunk)
        out[(mode, chunk)] = ([loop.run_round(r)["train_loss"] for r in range(2)], _state(loop))
    for key in (("streams", None), ("streams", 2)):
        assert out[key][0] == out[("sequential", None)][0], key
        _close(out[("sequential", None)][1], out[key][1], str(key), tol=0.0)


def test_streams_runner_without_rng_travel_would_differ():
    """The guard above can fail: one generator shared by interleaved clients gives other masks."""
    from fedlight.runners import streams

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    seq = contract_loop("fedavg", model=net, client_parallelism="sequential")
    ref = seq.run_round(0)["train_loss"]
    torch.manual_seed(0)
    net2 = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    par = contract_loop("fedavg", model=net2, client_parallelism="streams")
    real = streams._set_rng
    try:
        streams._set_rng = lambda state, dev: None
        assert par.run_round(0)["train_loss"] != ref
    finally:
        streams._set_rng = real


def _cuda_loop(mode: str, **kw):
    import lightning as L

    from fedlight.data import TensorClients
    from fedlight.engine.loop import FederatedLoop

    fabric = L.Fabric(accelerator="cuda", devices=1, precision="32-true")
    data = TensorClients(image_clients(), batch_size=4)
    data.setup(fabric.device, 0)
    cfg = LoopConfig(rounds=2, clients_per_round=3, local_steps=3, lr=0.05, progress=False, client_parallelism=mode,
                     **kw)
    loop = FederatedLoop(fabric, _frozen_cnn(), data, fedlight.create("fedsam"), cfg, 0, "unused")
    for r in range(2):
        loop.run_round(r)
    return loop


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("route", [dict(mode="streams", compile=False), dict(mode="vmap", channels_last=True,
                                                                               compile=False)])
def test_routes_on_cuda_equal_sequential(route, monkeypatch):
    """On the device: the streams route (really on streams here) and the channels-last stacked route against
    sequential training in fp32, TF32 convolutions off (torch's default lets cuDNN use them)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    route = dict(route)
    ref = _cuda_loop("sequential", compile=False)
    got = _cuda_loop(route.pop("mode"), **route)
    torch.testing.assert_close(P.flatten(got.x), P.flatten(ref.x), rtol=0, atol=1e-5)
    torch.testing.assert_close(P.flatten(got.buffers), P.flatten(ref.buffers), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ channels-last
def _grouped_calls(monkeypatch) -> list[tuple[int, bool]]:
    """(groups, input channels-last) of every ``conv2d`` the channels-last route makes (traced ones included)."""
    calls = []

    def conv2d(x, w, *args):
        calls.append((args[-1], x.is_contiguous(memory_format=torch.channels_last)))
        return torch.nn.functional.conv2d(x, w, *args)

    monkeypatch.setattr(nhwc, "F", SimpleNamespace(conv2d=conv2d))
    return calls


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "fedsam"])
def test_channels_last_stacked_equals_sequential_in_float64(name, monkeypatch):
    seq, rows_s = _trained(name, 3, precision="64-true", model=_frozen_cnn(), client_parallelism="sequential")
    calls = _grouped_calls(monkeypatch)
    nhwc_loop, rows_c = _trained(name, 3, precision="64-true", model=_frozen_cnn(), client_parallelism="vmap",
                                 channels_last=True)
    assert isinstance(nhwc_loop.runner, ChannelsLastStackedRunner)
    assert (3, True) in calls  # the route's grouped convolution really ran (3 clients), on channels-last input
    assert nhwc_loop.runner.description == "stacked, channels-last, eager"
    _close(_state(seq), _state(nhwc_loop), "state", tol=1e-10)
    assert rows_c == pytest.approx(rows_s, abs=1e-10)


def test_channels_last_stacked_compiled_and_in_float32(monkeypatch):
    """Compiled, the route's batching rule is what dynamo traces (not vmap's own convolution rule)."""
    torch._dynamo.reset()
    seq, rows_s = _trained("fedavg", model=_frozen_cnn(), client_parallelism="sequential")
    calls = _grouped_calls(monkeypatch)
    comp, rows_c = _trained("fedavg", model=_frozen_cnn(), client_parallelism="vmap", channels_last=True,
                            compile="aot_eager")
    assert comp.runner.description == "stacked, channels-last, compiled" and not comp.runner.fallbacks
    assert (3, True) in calls
    _close(_state(seq), _state(comp), "state", tol=1e-5)
    assert rows_c == pytest.approx(rows_s, abs=1e-5)


def test_the_stacked_convolution_keeps_channels_last_storage_end_to_end():
    """Two stacked convolutions: the first one's output is stored [B, H, W, C, ch], so the second reads it as a view
    of the grouped channels-last input, and its own output is stored the same way."""
    from torch.func import vmap

    C, B = 3, 2
    convs = [nn.Conv2d(4, 6, 3, padding=1).double(), nn.Conv2d(6, 5, 3, stride=2, padding=1, bias=False).double()]
    w = [torch.randn(C, *c.weight.shape, dtype=torch.float64) for c in convs]
    b = torch.randn(C, 6, dtype=torch.float64)
    x = torch.randn(C, B, 4, 8, 8, dtype=torch.float64)
    grouped = torch.nn.functional.conv2d

    def net(conv):
        def f(xc, w0, b0, w1):
            h = conv(xc, w0, b0, [1, 1], [1, 1], [1, 1], 1)
            return h, conv(torch.relu(h), w1, None, [2, 2], [1, 1], [1, 1], 1)
        return vmap(f)(x, w[0], b, w[1])

    h, y = net(stacked_conv2d)
    h_ref, y_ref = net(grouped)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-12)
    for t in (h, y):  # [C, B, ch, H, W] stored as [B, H, W, C, ch]
        assert t.permute(1, 3, 4, 0, 2).is_contiguous()
    assert not h_ref.permute(1, 3, 4, 0, 2).is_contiguous()  # vmap's own rule does not keep that layout


def test_the_stacked_convolution_is_autocast_as_each_clients_own_convolution():
    """Under bf16 autocast the route convolves in bf16, as the sequential runner's plain convolution does (on CPU,
    torch 2.x, vmap's own batched convolution is not autocast and stays float32)."""
    from torch.func import vmap

    x, w = torch.randn(2, 3, 4, 6, 6), torch.randn(2, 5, 4, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = vmap(lambda a, b: stacked_conv2d(a, b, None, [1, 1], [1, 1], [1, 1], 1))(x, w)
        each = torch.stack([torch.nn.functional.conv2d(x[c], w[c], None, 1, 1) for c in range(2)])
    assert mine.dtype == each.dtype == torch.bfloat16
    torch.testing.assert_close(mine.float(), each.float(), rtol=0, atol=0.125)


# ------------------------------------------------------------------------------------------------ auto
def _setup(device: str, local=None, model=None, task=None) -> TrainSetup:
    fabric = SimpleNamespace(device=torch.device(device), strategy=SimpleNamespace(precision=None))
    return TrainSetup(model=model or tiny_cnn(), local=local or LocalUpdateRule(), fabric=fabric, task=task,
                      optimizer=LoopConfig().optimizer_factory(), max_grad_norm=None, weight_decay=0.0, seed=0)


class _Sorting(LocalUpdateRule):
    stacked_unsupported = "it sorts the flattened model"


def test_auto_reads_its_table_per_device_and_gives_the_measurement():
    assert choice.pick(_setup("cuda")) == ("stacked", f"auto: {choice.AUTO['cuda'][0].why}")
    assert "1.33 s" in choice.AUTO["cuda"][0].why  # the measurement that ranks the default
    assert choice.pick(_setup("cpu")) == ("sequential", "auto: cpu device (stacked clients pay off on CUDA; force "
                                                        "with vmap)")
    assert choice.pick(_setup("meta"))[0] == "sequential"  # a device the table does not list: OTHER
    runner, why = choice.pick(_setup("cuda", local=_Sorting()))
    assert runner == "sequential" and why == "auto: the rule cannot run stacked (it sorts the flattened model)"
    streams_first = {"cuda": (choice.Route("streams", "measured fastest"), choice.Route("stacked", "x"))}
    assert choice.pick(_setup("cuda", local=_Sorting()), streams_first) == ("streams", "auto: measured fastest")
    blocked_first = {"cuda": (choice.Route("stacked", "x"), choice.Route("streams", "exact for every rule"))}
    assert choice.pick(_setup("cuda", local=_Sorting()), blocked_first) == (
        "streams", "auto: the rule cannot run stacked (it sorts the flattened model)")


def test_select_runner_builds_the_route_the_table_names(monkeypatch):
    monkeypatch.setitem(choice.AUTO, "cuda", (choice.Route("streams", "measured fastest"),))
    runner, why = select_runner(LoopConfig(), _setup("cpu"), "fedavg")
    assert isinstance(runner, SequentialRunner)
    # no CUDA stream is made before a chunk runs, so a CPU machine can build the CUDA choice
    runner, why = select_runner(LoopConfig(compile=False), _setup("cuda"), "fedavg")
    assert isinstance(runner, StreamsRunner) and why == "auto: measured fastest" and runner.compile is False


def test_named_routes_and_their_flags():
    runner, why = select_runner(LoopConfig(client_parallelism="streams", vmap_chunk=2), _setup("cpu"), "fedavg")
    assert isinstance(runner, StreamsRunner) and runner.chunk == 2 and why == "loop.client_parallelism: streams"
    assert runner.description == "streams, eager (no streams on CPU)"
    runner, _ = select_runner(LoopConfig(client_parallelism="streams"), _setup("cpu", local=_Sorting()), "sorting")
    assert isinstance(runner, StreamsRunner)  # streams run any rule: each client is the sequential runner's
    runner, _ = select_runner(LoopConfig(client_parallelism="vmap", channels_last=True), _setup("cpu"), "fedavg")
    assert isinstance(runner, ChannelsLastStackedRunner)
    runner, _ = select_runner(LoopConfig(channels_last=True), _setup("cuda"), "fedavg")
    assert isinstance(runner, ChannelsLastStackedRunner) and runner.forward.compiled
    runner, _ = select_runner(LoopConfig(client_parallelism="vmap"), _setup("cpu"), "fedavg")
    assert type(runner) is StackedRunner


def test_streams_chunks_reuse_their_model_copies():
    loop = make_loop(fedlight.create("fedavg"), image_clients(num_clients=5), tiny_cnn(), batch_size=4,
                     precision="32-true", client_parallelism="streams", vmap_chunk=2, clients_per_round=5)
    loop.run_round(0)
    slots = list(loop.runner.slots)
    loop.run_round(1)
    assert len(slots) == 2 and loop.runner.slots == slots and slots[0].setup.model is loop.model
