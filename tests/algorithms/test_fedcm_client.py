"""FedCM with persistent per-client momentum buffers (``fedcm_client``): golden numbers with partial participation,
the required properties of ALGORITHMS.md (β = 0 ≡ FedAvg, pure decay under a zero gradient, ‖v_k‖ ≤ G/(1 − β)
under clipping, buffers that persist across rounds and absences, zero buffers at the start), diagnostics,
checkpoint resume and argument validation."""

import fedtest
import numpy as np
import pytest
import torch
from fedtest import assert_params_close, grad, lin, linear_model, make_loop, norm, problem, run_rounds
from torch import nn

import fedlight
from fedlight.core import params as P
from fedlight.core.rules import Broadcast, LocalContext
from fedlight.core.sampling import sample_clients
from fedlight.errors import ConfigError

LR = 0.1


def np_params(p):
    return {k: v.detach().cpu().double().numpy() for k, v in p.items()}


def stored_v(loop, cid):
    return np_params(loop.store.get(cid, "cpu")["v"])


def test_golden_partial_participation_and_persistence():
    """4 clients, 2 per round, 4 rounds (seed 0: S = {0,3}, {0,3}, {1,3}, {0,1}): client 0 is absent in round 2
    and resumes with its buffer in round 3, client 1 starts from zeros in round 2, client 2 never trains."""
    beta, K, R, N = 0.9, 2, 4, 4
    clients, theta = problem(num_clients=N)
    loop = make_loop(fedlight.create("fedcm_client", beta=beta), clients, linear_model(theta), local_steps=K, lr=LR,
                     rounds=R, clients_per_round=2)
    x = theta
    v = [None] * N  # None: never trained (the store holds nothing)
    before = {}
    for r in range(R):
        S = sample_clients(N, 2, 0, r)
        deltas, norms, vs = [], [], []
        for i in S:
            vi = v[i] if v[i] is not None else {k: np.zeros_like(t) for k, t in theta.items()}  # zero at the start
            y = dict(x)
            for _ in range(K):
                vi = lin((beta, vi), (1, grad(y, *clients[i])))  # v ← βv + g
                y = lin((1, y), (-LR, vi))  # y ← y − ηv
            v[i] = vi
            norms.append(norm(vi))
            vs.append(vi)
            deltas.append(lin((1, y), (-1, x)))
        x = lin((1, x), *[(1 / len(S), d) for d in deltas])
        row = loop.run_round(r)
        assert_params_close(np_params(loop.x), x)
        for i in range(N):
            if v[i] is None:
                assert i not in loop.store
                continue
            assert_params_close(stored_v(loop, i), v[i])
            if i not in S and i in before:  # absent this round: bitwise unchanged
                for k, t in stored_v(loop, i).items():
                    np.testing.assert_array_equal(t, before[i][k])
        before = {i: stored_v(loop, i) for i in loop.store.ids()}
        # diagnostics over the sampled clients
        assert row["server/momentum_beta"] == beta
        assert row["server/avg_momentum_norm"] == pytest.approx(np.mean(norms), abs=1e-12)
        v_bar = lin(*[(1 / len(vs), vi) for vi in vs])
        var = np.mean([norm(lin((1, vi), (-1, v_bar))) ** 2 for vi in vs])  # variance of the vectors
        assert row["server/momentum_variance"] == pytest.approx(var, abs=1e-12)
        assert var > np.var(norms) + 1e-6  # not the variance of the norms
        assert row["server/effective_lr"] == pytest.approx(LR / (1 - beta))
        model_bytes = 8 * sum(t.size for t in theta.values())
        assert row["bytes_down"] == 2 * model_bytes and row["bytes_up"] == 4 * model_bytes  # comm (1, 2) per client
    assert sample_clients(N, 2, 0, 2) == [1, 3] and 0 in sample_clients(N, 2, 0, 3)  # the pattern described above


def test_a_dropped_client_keeps_its_buffer_and_decays_only_when_it_trains_again():
    """The page: a client that drops out for some rounds keeps its buffer, which decays only when it trains again.
    With ``loop.client_dropout`` = 0.5 (seed 0, 4 clients, 3 sampled a round) client 0 trains in round 0, is sampled
    but drops in round 1, is not sampled in round 2 and trains in round 3; client 1 trains in round 0, drops in
    round 2 and trains in round 3. A dropped client does not train: its stored v_k stays bitwise, and the reference
    (one β per local step it trains, none per round it misses, mean over the clients that report) is the loop's."""
    from fedlight.core.sampling import client_fails

    beta, K, R, N, p = 0.9, 2, 5, 4, 0.5
    clients, theta = problem(num_clients=N)
    loop = make_loop(fedlight.create("fedcm_client", beta=beta), clients, linear_model(theta), local_steps=K, lr=LR,
                     rounds=R, clients_per_round=3, client_dropout=p)
    x, v, kept = theta, [None] * N, []
    for r in range(R):
        S = sample_clients(N, 3, 0, r)
        dropped = [i for i in S if client_fails(0, r, i, p)]
        before = {i: stored_v(loop, i) for i in loop.store.ids()}
        deltas = []
        for i in (i for i in S if i not in dropped):
            vi = v[i] if v[i] is not None else {k: np.zeros_like(t) for k, t in theta.items()}
            y = dict(x)
            for _ in range(K):
                vi = lin((beta, vi), (1, grad(y, *clients[i])))  # v ← βv + g, from the kept buffer
                y = lin((1, y), (-LR, vi))
            v[i] = vi
            deltas.append(lin((1, y), (-1, x)))
        if deltas:
            x = lin((1, x), *[(1 / len(deltas), d) for d in deltas])
        row = loop.run_round(r)
        assert row["clients_dropped"] == len(dropped)
        assert_params_close(np_params(loop.x), x)
        for i in dropped:
            if i in before:  # dropped with a buffer: bitwise the same after the round
                kept.append((r, i))
                for k, t in stored_v(loop, i).items():
                    np.testing.assert_array_equal(t, before[i][k])
        for i in loop.store.ids():
            assert_params_close(stored_v(loop, i), v[i])
    assert kept == [(1, 0), (2, 1), (2, 2)]  # the absences described above, and client 2's (trained in round 1)


def test_round0_starts_from_zero_buffers():
    clients, theta = problem()
    loop = make_loop(fedlight.create("fedcm_client", beta=0.9), clients, linear_model(theta), local_steps=1, lr=LR,
                     rounds=1)
    assert len(loop.store) == 0
    run_rounds(loop, 1)
    for i, (xi, yi) in enumerate(clients):
        assert_params_close(stored_v(loop, i), grad(theta, xi, yi), tol=1e-12)  # v_1 = β·0 + g


def test_beta_zero_is_fedavg_bitwise():
    def run(name, **kw):
        clients, theta = problem()
        loop = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), local_steps=3, lr=LR, rounds=2,
                         precision="32-true", batch_size=2, weight_decay=1e-3, max_grad_norm=0.5)
        return run_rounds(loop, 2)

    base, other = run("fedavg"), run("fedcm_client", beta=0.0)
    for k in base:
        np.testing.assert_array_equal(other[k], base[k], err_msg=k)


def _ctx(model, v0, weight_decay=0.0):
    """A LocalContext whose objective has zero gradient everywhere."""
    live = P.trainable(model)
    opt = torch.optim.SGD(list(live.values()), lr=LR, weight_decay=weight_decay)
    return LocalContext(broadcast=Broadcast(P.clone(live)), optimizer=opt, lr=LR, num_steps=3, params=live,
                        state={"v": P.clone(v0)}, max_grad_norm=10.0,
                        objective=lambda m, batch: 0.0 * m(batch[0]).sum())


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_zero_gradient_is_pure_decay(weight_decay):
    beta = 0.7
    torch.manual_seed(0)
    model = nn.Linear(3, 3).double()
    v0 = {k: torch.randn_like(p) for k, p in P.trainable(model).items()}
    ctx = _ctx(model, v0, weight_decay)
    algo = fedlight.create("fedcm_client", beta=beta)
    algo.local.start(model, ctx)
    batch = (torch.randn(4, 3, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    for step in range(1, 4):
        y = P.clone(ctx.params)
        algo.local.step(model, batch, ctx)
        for k in v0:
            torch.testing.assert_close(ctx.state["v"][k], beta**step * v0[k], rtol=1e-15, atol=0)  # v ← βv
            # the step uses v; weight decay is the optimizer's and never enters the buffer
            want = y[k] - LR * (ctx.state["v"][k] + weight_decay * y[k])
            torch.testing.assert_close(ctx.params[k].detach(), want, rtol=0, atol=1e-15)


def test_buffer_norm_bound_under_clipping():
    """Gradients clipped to G = 0.05 with a large lr: after every round every stored ‖v_k‖ ≤ G/(1 − β), and the
    buffers do accumulate well beyond one clipped gradient (the bound is not vacuous)."""
    beta, G = 0.9, 0.05
    clients, theta = problem()
    loop = make_loop(fedlight.create("fedcm_client", beta=beta), clients, linear_model(theta), local_steps=4, lr=5.0,
                     rounds=5, max_grad_norm=G, weight_decay=1e-3)
    largest = 0.0
    for r in range(5):
        loop.run_round(r)
        for i in loop.store.ids():
            n = norm(stored_v(loop, i))
            assert n <= G / (1 - beta) * (1 + 1e-9), (r, i, n)
            largest = max(largest, n)
    assert largest > 5 * G


def test_checkpoint_resume_keeps_buffers(tmp_path):
    clients, theta = problem(num_clients=4)

    def mk(out):
        return make_loop(fedlight.create("fedcm_client", beta=0.9), clients, linear_model(theta), local_steps=2,
                         lr=LR, rounds=4, clients_per_round=2, out_dir=out)

    full = mk(tmp_path / "a")
    want = run_rounds(full, 4)
    first = mk(tmp_path / "b")
    for r in range(2):
        first.run_round(r)
    fedtest.save_checkpoint(first, first.out_dir)
    resumed = mk(tmp_path / "c")
    fedtest.resume(resumed, tmp_path / "b" / "checkpoints" / "last.ckpt")
    for r in (2, 3):
        resumed.run_round(r)
    got = np_params(resumed.x)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_norms_variance_option_uploads_delta_only():
    """``momentum_variance="norms"``: Var_S ‖v_k‖ from the averaged metrics, one model up; same trajectory."""
    clients, theta = problem(num_clients=4)
    rows, xs = {}, {}
    for mode in ("vectors", "norms"):
        loop = make_loop(fedlight.create("fedcm_client", beta=0.9, momentum_variance=mode), clients,
                         linear_model(theta), local_steps=2, lr=LR, rounds=2, clients_per_round=2)
        xs[mode] = run_rounds(loop, 2)
        rows[mode] = loop.rows[-1]
        norms = [norm(stored_v(loop, i)) for i in sample_clients(4, 2, 0, 1)]
    for k in xs["vectors"]:
        np.testing.assert_array_equal(xs["vectors"][k], xs["norms"][k])
    assert rows["norms"]["server/momentum_variance"] == pytest.approx(np.var(norms), abs=1e-12)
    assert rows["norms"]["bytes_up"] * 2 == rows["vectors"]["bytes_up"]


def test_default_beta_is_in_the_pages_default_range():
    assert 0.5 <= fedlight.create("fedcm_client").local.beta < 0.9


@pytest.mark.parametrize("kw,arg", [({"beta": -0.1}, "beta"), ({"beta": 1.0}, "beta"),
                                    ({"server_lr": 0.0}, "server_lr"),
                                    ({"momentum_variance": "x"}, "momentum_variance")])
def test_validation(kw, arg):
    with pytest.raises(ConfigError, match=f"`algorithm.{arg}`"):
        fedlight.create("fedcm_client", **kw)
