"""Every registered rule honours the contract: 2 rounds on a tiny BatchNorm CNN (4 clients, 3 per round)."""

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fedtest import contract_loop, resume, save_checkpoint

import fedlight
from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig
from fedlight.core.registry import get_algorithm

ALGOS = fedlight.list_algorithms()
MP_NAMES = [*ALGOS, "privacy_rules:DPScaffold"]


@pytest.mark.parametrize("name", ALGOS)
def test_two_rounds_train_and_account(name):
    loop = contract_loop(name)
    x0 = P.clone(loop.x)
    buf0 = P.clone(loop.buffers)
    rows = [loop.run_round(r) for r in range(2)]
    for row in rows:
        assert torch.isfinite(torch.tensor(row["train_loss"])), row
    assert bool(P.is_finite(loop.x))
    assert float(P.norm(P.sub(loop.x, x0))) > 0, "parameters did not change"
    assert any(not torch.equal(loop.buffers[k], buf0[k]) for k in buf0), "BatchNorm statistics not averaged"
    # communication: what was sent, in model-sized vectors, matches the registry's declaration
    model_bytes = P.nbytes(loop.x)
    down, up = get_algorithm(name).comm
    per_client = 3
    assert rows[-1]["bytes_down"] / (per_client * model_bytes) == pytest.approx(down, abs=0.05)
    assert rows[-1]["bytes_up"] / (per_client * model_bytes) == pytest.approx(up, abs=0.05)


@pytest.mark.parametrize("name", ALGOS)
def test_server_state_round_trips(name):
    loop = contract_loop(name)
    for r in range(2):
        loop.run_round(r)
    buf = io.BytesIO()
    torch.save(loop.server.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh = fedlight.create(name).server
    fresh.setup(P.clone(loop.x))
    fresh.load_state_dict(state)
    _assert_equal(fresh.state_dict(), loop.server.state_dict())


@pytest.mark.parametrize("name", ALGOS)
def test_resume_is_bitwise_exact(name, tmp_path):
    full = contract_loop(name, rounds=4)
    for r in range(4):
        full.run_round(r)
    first = contract_loop(name, rounds=4)
    for r in range(2):
        first.run_round(r)
    ckpt = save_checkpoint(first, tmp_path)
    second = contract_loop(name, rounds=4)
    resume(second, ckpt)
    assert second.state.rounds_done == 2
    for r in range(2, 4):
        second.run_round(r)
    _assert_equal(second.x, full.x)
    _assert_equal(second.buffers, full.buffers)
    _assert_equal(second.server.state_dict(), full.server.state_dict())


def test_sam_family_refuses_fp16(tmp_path):
    from fedlight.errors import ConfigError
    from fedlight.models import MLP

    for name in ALGOS:
        algo = fedlight.create(name)
        if not algo.local.needs_true_grad_norm:
            continue
        with pytest.raises(ConfigError, match="16-mixed"):
            fedlight.fit(MLP(), _tiny_data(), algo, LoopConfig(clients_per_round=2), precision="16-mixed",
                         out_dir=str(tmp_path / name))


def _tiny_data():
    from fedtest import image_clients

    from fedlight.data import TensorClients

    return TensorClients(image_clients(), batch_size=4)


def test_one_and_two_processes_agree(tmp_path):
    """Every rule, 2 rounds, on 1 process and on 2 gloo processes (client-parallel): same global model. The script's
    1-process run is made in this process (no interpreter start); its 2 processes are real ones, and the run they
    save covers every registered rule, and a private one (tests/privacy_rules.py: its central noise is drawn once
    from (seed, round) and added to the all-reduced sum, so 2 processes equal 1)."""
    import importlib.util

    script = Path(__file__).with_name("mp_contract.py")
    spec = importlib.util.spec_from_file_location("mp_contract", script)
    mp_contract = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp_contract)
    threads = torch.get_num_threads()
    try:
        mp_contract.main(1, str(tmp_path / "p1.pt"), "sequential", *MP_NAMES)
    finally:
        torch.set_num_threads(threads)
    res = subprocess.run([sys.executable, str(script), "2", str(tmp_path / "p2.pt"), "sequential", *MP_NAMES],
                         capture_output=True, text=True, timeout=900, cwd=script.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    outs = {n: torch.load(tmp_path / f"p{n}.pt", weights_only=True) for n in (1, 2)}
    assert sorted(outs[2]) == sorted(outs[1]) == sorted(MP_NAMES)
    for name in MP_NAMES:
        for k, v in outs[1][name].items():
            torch.testing.assert_close(outs[2][name][k], v, rtol=0, atol=1e-6, msg=f"{name}: {k}")


def _assert_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("name", [n for n in ALGOS if get_algorithm(n).backprops == 2])
def test_two_backprop_rules_update_batchnorm_once_per_step(name):
    """The perturbed second pass must not touch running statistics: after one local step they equal those of a
    single train-mode forward pass at the starting point."""
    import copy

    from fedtest import image_clients, tiny_cnn

    from fedlight.core.rules import Broadcast, LocalContext, cross_entropy

    model = tiny_cnn()
    ref = copy.deepcopy(model).train()
    algo = fedlight.create(name)
    x = P.clone(P.trainable(model))
    algo.server.setup(x)
    info = fedlight.RoundInfo(round=0, lr=0.1, num_steps=1, num_clients=4, sampled=[0])
    bc = algo.server.broadcast(x, info, 0)
    batch = (image_clients()[0][0][:4], image_clients()[0][1][:4])
    ctx = LocalContext(bc, torch.optim.SGD(model.parameters(), lr=0.1), 0.1, 1, P.trainable(model),
                       objective=cross_entropy)
    model.train()
    algo.local.start(model, ctx)
    algo.local.step(model, batch, ctx)
    with torch.no_grad():
        ref(batch[0])
    for (k, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, rb), (name, k)
    assert isinstance(bc, Broadcast)
