"""The routes past the grouped convolution (issue 31): clients on streams and the channels-last stacked route equal
the sequential runner; ``auto`` reads its table of measured routes."""

from types import SimpleNamespace

import pytest
import torch
from fedtest import DEVICES, contract_loop, image_clients, make_loop, tiny_cnn
from test_runner_stacked import _close, _frozen_cnn
from torch import nn

import fedlight
from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig
from fedlight.core.rules import LocalUpdateRule
from fedlight.errors import ConfigError
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
    assert par.runner.description == "streams, compiled (no streams or CUDA graphs on cpu)"
    assert len(par.runner.slots) == 2
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


def test_streams_runner_without_rng_travel_would_differ(monkeypatch):
    """The guard above can fail: one generator shared by interleaved clients gives other masks."""
    from fedlight.runners import interleave

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    seq = contract_loop("fedavg", model=net, client_parallelism="sequential")
    ref = seq.run_round(0)["train_loss"]
    torch.manual_seed(0)
    net2 = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    par = contract_loop("fedavg", model=net2, client_parallelism="streams")
    monkeypatch.setattr(interleave, "set_rng", lambda state, dev: None)
    assert par.run_round(0)["train_loss"] != ref


GRAPHS = {"cuda": "reduce-overhead", "cpu": "aot_eager"}
"""CUDA graphs on the device; on CPU, which has none, the same dynamo/AOTAutograd path without inductor's C++ build."""

ROUTES = {"streams+graphs": dict(client_parallelism="streams", compile="graphs"),
          "stacked+channels_last": dict(client_parallelism="vmap", channels_last=True, compile=False),
          "stacked+channels_last+graphs": dict(client_parallelism="vmap", channels_last=True, compile="graphs"),
          "stacked+graphs": dict(client_parallelism="vmap", compile="graphs")}


def _device_loop(device: str, model=None, rounds: int = 2, **kw):
    """FedSAM (two forward-backward passes a step) in fp32 on ``device``; ``compile: graphs``: :data:`GRAPHS`."""
    if kw.get("compile") == "graphs":
        kw["compile"] = GRAPHS[device]
    loop = make_loop(fedlight.create("fedsam"), image_clients(), model if model is not None else _frozen_cnn(),
                     rounds=rounds, local_steps=3, lr=0.05, clients_per_round=3, precision="32-true", batch_size=4,
                     accelerator=device, **kw)
    for r in range(rounds):
        loop.run_round(r)
    return loop


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", list(ROUTES))
def test_routes_equal_sequential_on_the_device(device, route, monkeypatch):
    """Each kept route against sequential training in fp32 (TF32 convolutions off: torch's default lets cuDNN use
    them), on CPU in CI and on CUDA in the GPU check; a BatchNorm CNN, so the channels-last route meets BatchNorm."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch._dynamo.reset()
    ref = _device_loop(device, client_parallelism="sequential", compile=False)
    got = _device_loop(device, **ROUTES[route])
    assert not getattr(got.runner, "fallbacks", [])  # the route itself trained, not a fallback
    torch.testing.assert_close(P.flatten(got.x), P.flatten(ref.x), rtol=0, atol=1e-5)
    torch.testing.assert_close(P.flatten(got.buffers), P.flatten(ref.buffers), rtol=0, atol=1e-5)
    if device == "cuda":  # the device-only part: really on streams / CUDA graphs
        assert got.runner.description.startswith(("streams, CUDA graphs", "stacked, channels-last, compiled with "
                                                  "CUDA graphs", "stacked, channels-last, eager",
                                                  "stacked, compiled with CUDA graphs"))


def _dropout_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Dropout(0.3), nn.Flatten(), nn.Linear(256, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_streams_keep_dropout_masks_as_sequential(device):
    """The streams route's place: a model with dropout. Each client's generator state travels with it, so its masks
    are the ones the sequential runner draws under the same compilation (CUDA graphs on the device). Until this
    passes on a GPU, ``auto`` does not take the route (:data:`fedlight.runners.choice.STREAMS_PENDING`)."""
    torch._dynamo.reset()
    ref = _device_loop(device, model=_dropout_net(), client_parallelism="sequential", compile="graphs")
    got = _device_loop(device, model=_dropout_net(), client_parallelism="streams", compile="graphs", vmap_chunk=2)
    torch.testing.assert_close(P.flatten(got.x), P.flatten(ref.x), rtol=0, atol=1e-6)


def _cuda_like_batch_norm(monkeypatch) -> None:
    """CUDA's batch norm asks an input whose strides look channels-last whether it is channels-last contiguous (the
    CPU kernel does not); under vmap that question raises "NYI: querying is_contiguous inside of vmap ..."."""
    real = torch.nn.functional.batch_norm

    def batch_norm(x, *args, **kw):
        if x.dim() == 4 and x.shape[1] > 1 and x.stride(1) == 1:
            x.is_contiguous(memory_format=torch.channels_last)
        return real(x, *args, **kw)

    monkeypatch.setattr(torch.nn.functional, "batch_norm", batch_norm)


def test_channels_last_stacked_with_batchnorm_asks_no_channels_last_question_under_vmap(monkeypatch):
    """Issue 42: the channels-last route with a BatchNorm CNN failed on CUDA with the NYI above; BatchNorm now gets
    its input in the default layout (the same numbers: the route equals sequential in the tests around)."""
    _cuda_like_batch_norm(monkeypatch)
    loop = contract_loop("fedavg", model=_frozen_cnn(), client_parallelism="vmap", channels_last=True)
    assert loop.run_round(0)["train_loss"] > 0
    with pytest.raises(RuntimeError, match="NYI: querying is_contiguous inside of vmap"):  # the emulation bites
        from torch.func import vmap

        vmap(lambda x: torch.nn.functional.batch_norm(x, None, None, training=True))(
            torch.randn(2, 3, 5, 5, 4).permute(0, 1, 4, 2, 3))


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
    first = choice.AUTO["cuda"][0]  # the fastest exact route of the measured table: stacked with CUDA graphs
    assert first.compile == "reduce-overhead" and "1.166 s/round = 2.09 x anchor (a) in issue 42's H200" in first.why
    times = choice.MEASURED["cuda"]
    assert [r.why.split(": ")[1].split(",")[0] for r in choice.AUTO["cuda"][:-1]] == sorted(
        ("stacked+graphs", "stacked+channels_last", "stacked", "streams+graphs"), key=times.__getitem__)
    assert "streams" not in times or times["streams"] > times["sequential+compiled"]  # why streams eager is gone
    dropout = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(64, 3))
    route, why = choice.pick_route(_setup("cuda", model=dropout))  # streams + graphs wait for their GPU check
    assert route.runner == "sequential" and "dropout" in why and choice.AUTO["cuda"][3].pending
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
    runner, why = select_runner(LoopConfig(), _setup("cuda"), "fedavg")
    assert isinstance(runner, StreamsRunner) and why == "auto: measured fastest"
    assert runner.compile == "reduce-overhead" and runner.description == "streams, CUDA graphs"
    with pytest.raises(ConfigError, match=r"streams` runs with CUDA graphs only .* not `loop.compile: True`"):
        select_runner(LoopConfig(client_parallelism="streams", compile=True), _setup("cuda"), "fedavg")


def test_named_routes_and_their_flags():
    runner, why = select_runner(LoopConfig(client_parallelism="streams", vmap_chunk=2), _setup("cpu"), "fedavg")
    assert isinstance(runner, StreamsRunner) and runner.chunk == 2 and why == "loop.client_parallelism: streams"
    assert runner.description == "streams, eager (no streams or CUDA graphs on cpu)"
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
