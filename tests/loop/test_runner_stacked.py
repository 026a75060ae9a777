"""``loop.client_parallelism: vmap`` trains the clients of a round stacked, and equals sequential training.

Every registered rule runs 3 rounds (4 clients, 3 per round, so stateful rules meet new and returning clients in
one round) in ``64-true`` both ways; global model, BatchNorm statistics, server state, per-client states and the
per-round losses agree to 1e-10.

The conv biases that feed BatchNorm are frozen here: BatchNorm removes their effect, so their gradient is zero
in exact arithmetic and ~1e-17 of rounding noise in practice, which Adam-type rules (Local AdamW, FedAdamW)
normalise into lr-sized steps (measured: 4e-10 apart on those two tensors, 1e-16 on every other). That is the
rounding of a zero, not a difference of the two execution paths.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fedtest import contract_loop, image_clients, make_loop, tiny_cnn

import fedlight
from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig
from fedlight.core.rules import Algorithm, LocalUpdateRule
from fedlight.errors import ConfigError

ALGOS = fedlight.list_algorithms()


def _frozen_cnn():
    model = tiny_cnn()
    mods = dict(model.named_modules())
    names = list(mods)
    for i, n in enumerate(names[:-1]):
        if isinstance(mods[n], (torch.nn.Conv2d, torch.nn.Linear)) and isinstance(
                mods[names[i + 1]], torch.nn.modules.batchnorm._BatchNorm) and mods[n].bias is not None:
            mods[n].bias.requires_grad_(False)
    return model


def _run(name: str, parallelism: str, rounds: int = 3, **kw):
    loop = contract_loop(name, precision="64-true", client_parallelism=parallelism, model=_frozen_cnn(), **kw)
    rows = [loop.run_round(r) for r in range(rounds)]
    return loop, rows


def _close(a, b, what, tol=1e-10):
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape, what
        torch.testing.assert_close(b.double(), a.double(), rtol=0, atol=tol, msg=what)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _close(a[k], b[k], f"{what}.{k}", tol)
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{what}[{i}]", tol)
    elif isinstance(a, float):
        assert b == pytest.approx(a, abs=tol), what
    else:
        assert a == b, what


@pytest.mark.parametrize("name", ALGOS)
def test_vmap_equals_sequential_in_float64(name):
    seq, rows_s = _run(name, "sequential")
    vec, rows_v = _run(name, "vmap")
    assert len(seq.x) < len(P.trainable(tiny_cnn())), "the pre-BatchNorm biases should be frozen"
    _close(seq.x, vec.x, "x")
    _close(seq.buffers, vec.buffers, "buffers")
    _close(seq.server.state_dict(), vec.server.state_dict(), "server")
    _close(seq.store.state_dict(), vec.store.state_dict(), "client states")
    for rs, rv in zip(rows_s, rows_v, strict=True):
        for k in ("train_loss", "flatness_distance", "bytes_up", "bytes_down", "clients_reported"):
            assert rv[k] == pytest.approx(rs[k], abs=1e-10), k
    assert float(P.norm(P.sub(vec.x, contract_loop(name).x))) > 0


def test_chunks_and_unequal_clients_match_sequential():
    """Clients of different sizes (different batch-size sequences) are grouped apart; ``vmap_chunk`` cuts groups."""
    clients = image_clients(num_clients=5, n=12)
    clients[1] = (clients[1][0][:7], clients[1][1][:7])  # batches 4, 3, 4: its own group
    clients[3] = (clients[3][0][:9], clients[3][1][:9])  # batches 4, 4, 1
    out = {}
    for mode, chunk in (("sequential", None), ("vmap", None), ("vmap", 2)):
        loop = make_loop(fedlight.create("scaffold"), clients, tiny_cnn(), rounds=2, local_epochs=1, local_steps=None,
                         batch_size=4, clients_per_round=5, client_parallelism=mode, vmap_chunk=chunk)
        rows = [loop.run_round(r) for r in range(2)]
        out[(mode, chunk)] = (loop.x, loop.store.state_dict(), [r["train_loss"] for r in rows])
    ref = out[("sequential", None)]
    for key in (("vmap", None), ("vmap", 2)):
        _close(ref[0], out[key][0], f"{key} x", tol=1e-5)
        _close(ref[1], out[key][1], f"{key} states", tol=1e-5)
        _close(ref[2], out[key][2], f"{key} loss", tol=1e-5)


def test_vmap_groups_clients_by_steps_batches_and_state():
    from fedlight.runners.stacking import chunks

    sig = {0: "a", 1: "b", 2: "a", 3: "a", 4: "b"}
    assert chunks([0, 1, 2, 3, 4], sig.__getitem__, None) == [[0, 2, 3], [1, 4]]
    assert chunks([0, 1, 2, 3, 4], sig.__getitem__, 2) == [[0, 2], [3], [1, 4]]


def test_a_rule_that_cannot_run_stacked_is_refused_before_training(tmp_path):
    class Sorting(LocalUpdateRule):
        stacked_unsupported = "it sorts the flattened model"

    with pytest.raises(ConfigError, match=r"client_parallelism: vmap.*sorts the flattened model.*sequential"):
        make_loop(Algorithm(Sorting()), image_clients(), tiny_cnn(), client_parallelism="vmap")


def test_vmap_chunk_is_validated():
    with pytest.raises(ConfigError, match="loop.vmap_chunk"):
        LoopConfig(vmap_chunk=0)


def test_two_processes_with_vmap_equal_one_sequential(tmp_path):
    names = ["fedavg", "scaffold", "fedsam", "fedcm_client"]
    script = Path(__file__).parent.parent / "algorithms" / "mp_contract.py"
    out = tmp_path / "p2.pt"
    res = subprocess.run([sys.executable, str(script), "2", str(out), "vmap", *names], capture_output=True,
                         text=True, timeout=600, cwd=script.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    for name in names:
        loop = contract_loop(name)
        for r in range(2):
            loop.run_round(r)
        want = {**{f"x.{k}": v for k, v in loop.x.items()}, **{f"b.{k}": v for k, v in loop.buffers.items()}}
        for k, v in want.items():
            torch.testing.assert_close(got[name][k], v, rtol=0, atol=1e-6, msg=f"{name}: {k}")


def test_vmap_runs_under_bf16_autocast():
    """Mixed precision inside vmap: autocast really runs (results differ from 32-true) and tracks sequential."""
    out = {}
    for precision, mode in (("bf16-mixed", "sequential"), ("bf16-mixed", "vmap"), ("32-true", "vmap")):
        loop = contract_loop("fedsam", precision=precision, client_parallelism=mode)
        loop.run_round(0)
        out[(precision, mode)] = P.flatten(loop.x)
    seq, vec, fp32 = out[("bf16-mixed", "sequential")], out[("bf16-mixed", "vmap")], out[("32-true", "vmap")]
    assert float((vec - fp32).abs().max()) > 1e-6
    torch.testing.assert_close(vec, seq, rtol=0, atol=1e-2)


@pytest.mark.parametrize("name", ["scaffold", "fedadamw"])
def test_vmap_equals_sequential_with_the_in_round_cosine(name):
    """``loop.local_lr_schedule: cosine`` sets each step's lr the same way in both runners."""
    seq, _ = _run(name, "sequential", rounds=2, local_lr_schedule="cosine")
    vec, _ = _run(name, "vmap", rounds=2, local_lr_schedule="cosine")
    flat, _ = _run(name, "sequential", rounds=2)
    _close(seq.x, vec.x, "x")
    _close(seq.server.state_dict(), vec.server.state_dict(), "server")
    assert not all(torch.equal(seq.x[k], flat.x[k]) for k in seq.x)
