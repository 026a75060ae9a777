"""Client runners: which one the loop picks and why, the compiled stacked path, BatchNorm under mixed precision."""

from types import SimpleNamespace

import pytest
import torch
from fedtest import DEVICES, contract_loop, grad, image_clients, linear_model, make_loop, problem, tiny_cnn
from torch import nn

import fedlight
from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig
from fedlight.core.rules import LocalUpdateRule
from fedlight.runners import SequentialRunner, StackedRunner, TrainSetup, select_runner
from fedlight.tasks import Classification


def _setup(device: str, local=None, model=None) -> TrainSetup:
    fabric = SimpleNamespace(device=torch.device(device), strategy=SimpleNamespace(precision=None))
    return TrainSetup(model=model or tiny_cnn(), local=local or LocalUpdateRule(), fabric=fabric,
                      optimizer=LoopConfig().optimizer_factory(), max_grad_norm=None, weight_decay=0.0, seed=0,
                      task=Classification())


def test_auto_picks_sequential_on_cpu_and_says_why():
    runner, why = select_runner(LoopConfig(), _setup("cpu"), "fedavg")
    assert isinstance(runner, SequentialRunner) and "cpu device" in why


def test_auto_picks_compiled_stacked_on_cuda():
    runner, why = select_runner(LoopConfig(), _setup("cuda"), "fedavg")
    assert isinstance(runner, StackedRunner) and runner.forward.compiled and why.startswith("auto: CUDA")
    eager, _ = select_runner(LoopConfig(compile=False), _setup("cuda", model=tiny_cnn(1)), "fedavg")
    assert isinstance(eager, StackedRunner) and not eager.forward.compiled


def test_auto_falls_back_to_sequential_with_the_reason():
    class Sorting(LocalUpdateRule):
        stacked_unsupported = "it sorts the flattened model"

    runner, why = select_runner(LoopConfig(), _setup("cuda", local=Sorting()), "sorting")
    assert isinstance(runner, SequentialRunner) and "sorts the flattened model" in why
    dropout = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(64, 3))
    runner, why = select_runner(LoopConfig(), _setup("cuda", model=dropout), "fedavg")
    assert isinstance(runner, SequentialRunner) and "dropout" in why


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "fedsam", "fedwmsam"])
def test_compiled_stacked_equals_sequential(name):
    """torch.compile over the stacked loss (the aot_eager backend: the traced graphs are what runs)."""
    torch._dynamo.reset()
    seq = contract_loop(name, precision="64-true", client_parallelism="sequential")
    comp = contract_loop(name, precision="64-true", client_parallelism="vmap", compile="aot_eager")
    assert comp.runner.forward.compiled
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for r in range(2):
        rs, rc = seq.run_round(r), comp.run_round(r)
        assert rc["train_loss"] == pytest.approx(rs["train_loss"], abs=1e-10)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames  # really traced, not eager
    for k in seq.x:
        torch.testing.assert_close(comp.x[k], seq.x[k], rtol=0, atol=1e-10, msg=k)
    for k in seq.buffers:
        torch.testing.assert_close(comp.buffers[k], seq.buffers[k], rtol=0, atol=1e-10, msg=k)


def test_eager_stacked_batchnorm_gets_float32_inputs_under_mixed_precision():
    """vmap + autocast + BatchNorm: the stacked path feeds BatchNorm float32 (CUDA's eager kernel otherwise refuses
    bf16 inputs beside float32 running statistics); results track the sequential bf16 run."""
    seen = []
    out = {}
    for mode in ("sequential", "vmap"):
        loop = contract_loop("fedavg", precision="bf16-mixed", client_parallelism=mode)
        bn = [m for m in loop.model.modules() if isinstance(m, nn.BatchNorm2d)]
        handles = [m.register_forward_pre_hook(lambda _m, a: seen.append((mode, a[0].dtype))) for m in bn]
        loop.run_round(0)
        for h in handles:
            h.remove()
        out[mode] = (P.flatten(loop.x), P.flatten(loop.buffers))
    assert {d for m, d in seen if m == "vmap"} == {torch.float32}
    assert {d for m, d in seen if m == "sequential"} == {torch.bfloat16}  # the hook is the stacked path's only
    torch.testing.assert_close(out["vmap"][0], out["sequential"][0], rtol=0, atol=2e-2)
    torch.testing.assert_close(out["vmap"][1], out["sequential"][1], rtol=0, atol=5e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_batchnorm_stacked_bf16_on_the_device(device, compile):
    """The failure this guards against happens only in CUDA's eager batch_norm under vmap; the CPU value runs the
    same construction in CI."""
    loop = make_loop(fedlight.create("fedavg"), image_clients(), tiny_cnn(), rounds=1, local_steps=3, lr=0.05,
                     clients_per_round=3, precision="bf16-mixed", batch_size=4, accelerator=device,
                     client_parallelism="vmap", compile=compile)
    assert loop.runner.description == f"stacked, {'compiled' if compile else 'eager'}"
    row = loop.run_round(0)
    assert 0 < row["train_loss"] < 10 and not loop.runner.fallbacks


def test_round_row_lists_sampled_clients_and_per_client_results():
    loop = contract_loop("scaffold")
    row = loop.run_round(0)
    assert row["sampled"] == [c["id"] for c in row["clients"]] and len(row["sampled"]) == 3
    ref = contract_loop("scaffold")
    for entry in row["clients"]:
        from fedlight.runners.base import ClientJob

        plan = ref.plan(0)
        job = next(j for j in ref.jobs(plan) if j.client_id == entry["id"])
        assert isinstance(job, ClientJob)
        out = ref.runner.train_one(job, plan.info, ref.buffers)
        assert entry["delta_norm"] == pytest.approx(float(P.norm(out.result.delta)), rel=1e-6)
        assert entry["train_loss"] == pytest.approx(float(out.train_loss), rel=1e-6)
        assert entry["num_samples"] == ref.data.num_samples(entry["id"])


def test_server_aggregate_override_gets_every_client_result():
    """A server rule that overrides ``aggregate`` (coordinate-wise median) is honoured: golden value by hand."""
    import numpy as np
    from robust_rules import MedianFedAvg

    clients, theta0 = problem(num_clients=3, n=4)
    loop = make_loop(MedianFedAvg(), clients, linear_model(theta0), rounds=1, local_steps=2, lr=0.1)
    loop.run_round(0)
    deltas = []
    for x, y in clients:  # each client: 2 full-batch gradient steps from x_0
        t = {k: v.copy() for k, v in theta0.items()}
        for _ in range(2):
            g = grad(t, x, y)
            t = {k: t[k] - 0.1 * g[k] for k in t}
        deltas.append({k: t[k] - theta0[k] for k in t})
    for k in theta0:
        want = theta0[k] + np.median(np.stack([d[k] for d in deltas]), axis=0)
        np.testing.assert_allclose(loop.x[k].numpy(), want, rtol=0, atol=1e-12, err_msg=k)
    mean = theta0["weight"] + np.mean(np.stack([d["weight"] for d in deltas]), axis=0)
    assert np.abs(loop.x["weight"].numpy() - mean).max() > 1e-4  # the median really differs from the mean here


def test_server_aggregate_override_on_two_processes_equals_one(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from robust_rules import MedianFedAvg

    script = Path(__file__).parent.parent / "algorithms" / "mp_contract.py"
    out = tmp_path / "p2.pt"
    res = subprocess.run([sys.executable, str(script), "2", str(out), "sequential", "robust_rules:MedianFedAvg"],
                         capture_output=True, text=True, timeout=600, cwd=script.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = torch.load(out, weights_only=True)["robust_rules:MedianFedAvg"]
    loop = make_loop(MedianFedAvg(), image_clients(), tiny_cnn(), local_steps=3, lr=0.05, clients_per_round=3,
                     precision="32-true", weight_decay=1e-3, max_grad_norm=10.0, batch_size=4)
    for r in range(2):
        loop.run_round(r)
    for k, v in loop.x.items():
        torch.testing.assert_close(got[f"x.{k}"], v, rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("norm", ["group", "batch"])
def test_stacked_resnet18_loss_traces_as_one_graph(norm):
    """The structural guard for CUDA graphs (``loop.compile: reduce-overhead``): the stacked ResNet-18 loss under
    bf16 autocast traces into a single graph — no graph break, so no host sync (``.item()``, data-dependent
    Python) inside the forward/backward that would have to leave the captured graph."""
    import lightning as L

    from fedlight.core.rules import cross_entropy
    from fedlight.models import ResNet18
    from fedlight.runners.forward import StackedForward

    torch._dynamo.reset()
    model = ResNet18(num_classes=10, norm=norm)
    fwd = StackedForward(model, L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed"))
    C, B = 2, 2
    params = {k: v.detach().expand(C, *v.shape).clone().requires_grad_() for k, v in P.trainable(model).items()}
    buffers = {k: v.expand(C, *v.shape).clone() for k, v in P.float_buffers(model).items()}
    batch = (torch.randn(C, B, 3, 32, 32), torch.randint(0, 10, (C, B)))
    explained = torch._dynamo.explain(fwd._losses)(params, buffers, batch, cross_entropy)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def test_a_wrapped_server_rule_keeps_its_aggregate_override():
    """A server wrapper (e.g. a momentum server around a robust one) must not hide the inner rule's aggregate."""
    from robust_rules import MedianServer

    from fedlight.algorithms.compose import ServerWrapper
    from fedlight.core.rules import Algorithm

    plain = make_loop(Algorithm(server=MedianServer()), image_clients(), tiny_cnn(), batch_size=4, local_steps=3,
                      precision="32-true", clients_per_round=3)
    wrapped = make_loop(Algorithm(server=ServerWrapper(MedianServer())), image_clients(), tiny_cnn(), batch_size=4,
                        local_steps=3, precision="32-true", clients_per_round=3)
    assert wrapped.custom_aggregate
    for r in range(2):
        plain.run_round(r)
        wrapped.run_round(r)
    for k in plain.x:
        torch.testing.assert_close(wrapped.x[k], plain.x[k], rtol=0, atol=0, msg=k)


def test_failing_cuda_graphs_fall_back_to_the_compiled_stacked_step(monkeypatch):
    """``auto``'s route on CUDA is the stacked step with CUDA graphs; when the graphs fail (compiling or first
    running a shape, e.g. a rule that keeps a graph's output past the next replay), the runner goes on compiled
    without them, redoing the chunk: the numbers are the sequential runner's. (CPU: every compile is aot_eager.)"""
    import fedlight.runners.forward as forward

    torch._dynamo.reset()
    monkeypatch.setattr(forward, "compile_kwargs", lambda compile: {"backend": "aot_eager"})
    seq = contract_loop("fedsam", client_parallelism="sequential")
    loop = contract_loop("fedsam", client_parallelism="vmap")
    loop.runner = runner = StackedRunner(loop.runner.setup, None, "reduce-overhead")
    assert runner.description == "stacked, compiled with CUDA graphs"

    def overwritten(*args, **kw):
        raise RuntimeError("Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run")

    runner.forward.fn = overwritten
    for r in range(2):
        assert loop.run_round(r)["train_loss"] == pytest.approx(seq.run_round(r)["train_loss"], abs=1e-5)
    assert runner.description == "stacked, compiled" and len(runner.fallbacks) == 1
    assert runner.fallbacks[0].startswith("the CUDA graphs of the stacked step failed (RuntimeError: Error: accessing")
    torch.testing.assert_close(P.flatten(loop.x), P.flatten(seq.x), rtol=0, atol=1e-5)
