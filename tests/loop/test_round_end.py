"""The stacked runner's data path and round end (issue 57, parts 2 and 3) change no bit of a run.

Today's route, restored here by monkeypatching: each client's batches drawn alone and stacked, each client's outcome
copied out of the chunk's stacks, and finiteness decided per client with a host sync each. The new route: one gather
per stacked step, outcomes that are views into the stacks, and one finiteness decision per chunk read with one host
sync per round. Over 3 rounds of CIFAR-like images with crop + flip (stateless, stateful and SAM rules, BatchNorm),
the global model, buffers, every client state and every per-client loss are ``torch.equal``; a planted non-finite
client is skipped or stops the run exactly as before.
"""

import lightning as L
import pytest
import torch
from data.test_gather import Images  # tests/ is on the path (conftest)
from fedtest import DEVICES, image_clients, make_loop, tiny_cnn

import fedlight
from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig, LRSchedule
from fedlight.data import gather
from fedlight.engine.loop import Diverged, FederatedLoop
from fedlight.models import SmallCNN
from fedlight.runners import stacked, stacking
from fedlight.runners.base import ClientOutcome


def today(monkeypatch):
    """Restore the route before issue 57: per-client batches, copied slices, a host sync per client."""
    monkeypatch.setattr("fedlight.engine.loop.gather.supports", lambda data: False)
    monkeypatch.setattr(stacked.StackedRunner, "holds_round", False)
    monkeypatch.setattr(stacked, "chunk_finite", lambda delta, losses: [None] * len(losses))
    copy = stacking.slice_tree
    monkeypatch.setattr(stacked, "slice_tree", lambda tree, i, n, _copy=True: copy(tree, i, n, True))


def image_loop(name: str, seed: int = 0, device: str = "cpu") -> FederatedLoop:
    data = Images(num_clients=6, batch_size=4)
    fabric = L.Fabric(accelerator=device, devices=1, precision="32-true")
    data.setup(fabric.device, seed)
    torch.manual_seed(seed)
    model = SmallCNN(in_channels=3, num_classes=4, width=4, norm="batch")
    cfg = LoopConfig(rounds=3, clients_per_round=3, local_steps=3, lr=0.05, lr_schedule=LRSchedule("exponential", 0.9),
                     progress=False, client_parallelism="vmap", compile=False, weight_decay=1e-3)
    return FederatedLoop(fabric, model, data, fedlight.create(name), cfg, seed, "unused", data.default_task())


def trained(loop: FederatedLoop) -> dict:
    rows = [loop.run_round(r) for r in range(loop.cfg.rounds)]
    st = loop.state
    return {"params": st.params, "buffers": st.buffers,
            "states": {c: st.store.get(c, "cpu") for c in range(loop.data.num_clients)},
            "clients": [[(e["id"], e["train_loss"], e["delta_norm"]) for e in row["clients"]] for row in rows],
            "losses": [row["train_loss"] for row in rows]}


def assert_equal(a, b, what="run"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_equal(a[k], b[k], f"{what}.{k}")
    else:
        assert a == b, what


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fedavg", "scaffold", "fednsam"])
def test_one_gather_and_the_chunk_round_end_are_bitwise_today(name, device, monkeypatch):
    calls, one_gather = [], gather.stacked_batches
    monkeypatch.setattr(gather, "stacked_batches", lambda *a: calls.append(1) or one_gather(*a))
    new = trained(image_loop(name, device=device))
    assert len(calls) >= 3, "the new route gathers every chunk at once"
    with monkeypatch.context() as m:
        today(m)
        old = trained(image_loop(name, device=device))
    assert_equal(new, old)
    if name == "scaffold":
        assert any(new["states"].values()), "the check wants client states"


def test_the_stacked_round_end_checks_no_client_alone(monkeypatch):
    """The chunk's flags decide: the per-client check (and its host sync) never runs on the stacked route."""
    loop, seen = image_loop("fedavg"), []
    decide = ClientOutcome.finite

    def finite(out):
        seen.append(out.finite_flag is not None)
        return decide(out)

    monkeypatch.setattr(ClientOutcome, "finite", finite)
    loop.run_round(0)
    assert seen == [True] * 3


def nan_clients():
    clients = image_clients()
    clients[1] = (torch.full_like(clients[1][0], float("nan")), clients[1][1])  # client 1 yields NaN losses
    return clients


def nan_loop(policy: str):
    return make_loop(fedlight.create("scaffold"), nan_clients(), tiny_cnn(), rounds=3, local_steps=3, lr=0.05,
                     clients_per_round=3, batch_size=4, precision="32-true", client_parallelism="vmap",
                     compile=False, on_nonfinite=policy)


def test_a_planted_nonfinite_client_is_skipped_as_today(monkeypatch):
    def run():
        loop = nan_loop("skip_client")
        rows = [loop.run_round(r) for r in range(3)]
        return [r["clients_skipped_nonfinite"] for r in rows], P.clone(loop.state.params)

    skipped, params = run()
    with monkeypatch.context() as m:
        today(m)
        skipped_then, params_then = run()
    assert skipped == skipped_then and sum(skipped) > 0
    assert_equal(params, params_then)


def test_a_planted_nonfinite_client_stops_as_today(monkeypatch):
    def stop():
        loop = nan_loop("stop")
        with pytest.raises(Diverged) as e:
            for r in range(3):
                loop.run_round(r)
        return str(e.value)

    said = stop()
    with monkeypatch.context() as m:
        today(m)
        assert stop() == said
    assert "client 1 produced a non-finite loss or update" in said


def test_a_job_given_other_batches_keeps_them():
    """Code that replaces a job's ``batches`` (``dataclasses.replace``) is obeyed: the one-gather path stands only for
    the batches the loop made."""
    from dataclasses import replace

    loop = image_loop("fedavg")
    jobs = loop.jobs(loop.plan(0))
    assert stacked.stacked_batches(jobs).__name__ == "stacked_batches"  # the gather's generator
    other = [replace(j, batches=lambda j=j: j.batches()) for j in jobs]
    got = list(stacked.stacked_batches(other))
    want = list(stacked.stacked_batches(jobs))
    assert len(got) == len(want) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(got, want))
    assert stacked.stacked_batches(other).__name__ == "<genexpr>"  # each client's own batches, stacked
