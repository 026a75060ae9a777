"""Unequal client sizes (5, 8, 12, 12 samples): every rule's server averages with the weights its paper writes.

``test_server_means_use_the_papers_weights`` runs every registered rule for two rounds (64-true, full batch,
``loop.weighting: samples``) and checks what reaches ``ServerRule.update`` against the clients' own uploads,
recomputed here: Δ̄ and each averaged upload are Σ w_i·u_i with w_i ∝ n_i for the rules that follow the loop's
weighting and w_i = 1/|S| for those whose paper writes a plain mean over S (FedDyn and the rules built on its server,
FedSWA, FedMoSWA, FedAdamW); summed uploads (SCAFFOLD-style Δc_i) are plain sums. The golden tests below re-derive
whole trajectories by hand for the rules whose paper mixes |S| and N (FedDyn, SCAFFOLD, FedMoSWA, FedAdamW's v̄)."""

import numpy as np
import pytest
from fedtest import C, D, assert_params_close, grad, lin, linear_model, make_loop, norm, run_rounds

import fedlight
from fedlight.core.sampling import sample_clients

SIZES = (5, 8, 12, 12)
K, LR = 2, 0.1

# Rules whose paper writes every server mean as a plain mean over the sampled clients (see each rule's docstring).
UNIFORM = {"feddyn", "fednsam_d", "fedlesam_d", "fedsmoo", "fedspeed", "fedswa", "fedmoswa", "fedadamw"}


def unequal_problem(sizes=SIZES, seed=1):
    rng = np.random.default_rng(seed)
    clients = [(rng.integers(-4, 5, size=(n, D)) / 4.0, rng.integers(0, C, size=n)) for n in sizes]
    theta = {"weight": rng.integers(-4, 5, size=(C, D)) / 8.0, "bias": rng.integers(-4, 5, size=C) / 8.0}
    return clients, theta


def np_params(p):
    return {k: v.detach().cpu().double().numpy() for k, v in p.items()}


def wmean(ds, w):
    return lin(*[(wi / sum(w), d) for wi, d in zip(w, ds)])


@pytest.mark.parametrize("name", fedlight.list_algorithms())
def test_server_means_use_the_papers_weights(name):
    clients, theta = unequal_problem()
    algo = fedlight.create(name)
    loop = make_loop(algo, clients, linear_model(theta), local_steps=K, lr=LR, rounds=2, weighting="samples")
    uploads, seen = [], []
    finish, update = loop.local.finish, loop.server.update

    def record_finish(model, ctx):
        res = finish(model, ctx)
        uploads.append((len(clients[ctx.client_id][1]), np_params(res.delta),
                        {k: np_params(v) for k, v in res.extras.items()}))
        return res

    def record_update(params, agg, info):
        seen.append((np_params(agg.delta), {k: np_params(v) for k, v in agg.extras.items()}))
        return update(params, agg, info)

    loop.local.finish, loop.server.update = record_finish, record_update
    run_rounds(loop, 2)
    assert (algo.server.weighting == "uniform") == (name in UNIFORM), algo.server.weighting
    per_round = len(clients)
    for r, (delta, extras) in enumerate(seen):
        ups = uploads[r * per_round:(r + 1) * per_round]
        w = [1.0] * len(ups) if name in UNIFORM else [float(n) for n, _, _ in ups]
        want = wmean([d for _, d, _ in ups], w)
        assert_params_close(delta, want, tol=1e-12)
        other = wmean([d for _, d, _ in ups], [float(n) for n, _, _ in ups] if name in UNIFORM else [1.0] * len(ups))
        assert norm(lin((1, want), (-1, other))) > 1e-4  # the two readings differ on this problem
        for key, got in extras.items():
            us = [e[key] for _, _, e in ups]
            if key in loop.server.summed_extras:
                assert_params_close(got, lin(*[(1, u) for u in us]), tol=1e-12)
            else:
                assert_params_close(got, wmean(us, w), tol=1e-12)


def _loop(name, clients, theta, rounds, per_round=None, **kw):
    loop = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), local_steps=K, lr=LR, rounds=rounds,
                     clients_per_round=per_round, weighting="samples")
    return loop, run_rounds(loop, rounds)


def test_feddyn_unequal_sizes_golden():
    """ALGORITHMS.md/Acar et al.: h ← h − α·(1/N)·Σ_{i∈S}(y_i − x); x ← (1/|S|)·Σ_{i∈S} y_i − h/α, no sample
    weights. 3 rounds, 3 of 4 clients per round; the sample-weighted reading ends ≥ 0.05 away."""
    a, N, R = 0.1, len(SIZES), 3
    clients, theta = unequal_problem()
    loop, got = _loop("feddyn", clients, theta, R, per_round=3, alpha=a)

    def reference(weighted):
        x, h = dict(theta), {k: np.zeros_like(v) for k, v in theta.items()}
        gL = [{k: np.zeros_like(v) for k, v in theta.items()} for _ in clients]
        for r in range(R):
            S = sample_clients(N, 3, 0, r)
            ys = []
            for i in S:
                y = dict(x)
                for _ in range(K):
                    y = lin((1, y), (-LR, lin((1, grad(y, *clients[i])), (-1, gL[i]), (a, y), (-a, x))))
                gL[i] = lin((1, gL[i]), (-a, y), (a, x))
                ys.append(y)
            w = [float(SIZES[i]) for i in S] if weighted else [1.0] * len(S)
            D_sum = lin(*[(len(S) * wi / sum(w), lin((1, y), (-1, x))) for wi, y in zip(w, ys)])
            h = lin((1, h), (-a / N, D_sum))
            x = lin((1, wmean(ys, w)), (-1 / a, h))
        return x, h

    x, h = reference(weighted=False)
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.h), h)
    x_w, _ = reference(weighted=True)
    assert norm(lin((1, x), (-1, x_w))) > 0.05


def test_scaffold_unequal_sizes_golden():
    """c ← c + (1/N)·Σ_{i∈S} Δc_i (a sum over S divided by N, whatever the sizes); x ← x + Δ̄ (sample-weighted,
    the loop's convention for Δ̄)."""
    N, R = len(SIZES), 3
    clients, theta = unequal_problem()
    loop, got = _loop("scaffold", clients, theta, R, per_round=2)
    z = {k: np.zeros_like(v) for k, v in theta.items()}
    x, c, ci = dict(theta), dict(z), [dict(z) for _ in clients]
    for r in range(R):
        S = sample_clients(N, 2, 0, r)
        ds, dcs = [], []
        for i in S:
            y = dict(x)
            for _ in range(K):
                y = lin((1, y), (-LR, lin((1, grad(y, *clients[i])), (1, c), (-1, ci[i]))))
            new = lin((1, ci[i]), (-1, c), (-1 / (K * LR), lin((1, y), (-1, x))))
            dcs.append(lin((1, new), (-1, ci[i])))
            ci[i] = new
            ds.append(lin((1, y), (-1, x)))
        x = lin((1, x), (1, wmean(ds, [float(SIZES[i]) for i in S])))
        c = lin((1, c), *[(1 / N, dc) for dc in dcs])
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.c), c)


def test_fedmoswa_unequal_sizes_golden():
    """Algorithm 1 (FedSWA paper), lines 8–17, with plain means over S: m ← m + γ·(1/s)·ΣΔc_i;
    x ← x + α·((1/s)·Σ y_i − x); η_k = η_l·(1 − (1 − ρ)·k/K)."""
    rho, alpha, gamma, R = 0.2, 0.7, 0.4, 3
    clients, theta = unequal_problem()
    loop, got = _loop("fedmoswa", clients, theta, R, rho=rho, alpha=alpha, gamma=gamma)
    z = {k: np.zeros_like(v) for k, v in theta.items()}
    x, m, ci = dict(theta), dict(z), [dict(z) for _ in clients]
    etas = [LR * (1 - (1 - rho) * k / K) for k in range(K)]
    for _ in range(R):
        ys, dcs = [], []
        for i, (xi, yi) in enumerate(clients):
            y = dict(x)
            for eta in etas:
                y = lin((1, y), (-eta, lin((1, grad(y, xi, yi)), (-1, ci[i]), (1, m))))
            new = lin((1, ci[i]), (-1, m), (1 / sum(etas), lin((1, x), (-1, y))))
            dcs.append(lin((1, new), (-1, m)))
            ci[i] = new
            ys.append(y)
        m = lin((1, m), (gamma, wmean(dcs, [1.0] * len(dcs))))
        x = lin((1, x), (alpha, lin((1, wmean(ys, [1.0] * len(ys))), (-1, x))))
    assert_params_close(got, x)
    assert_params_close(np_params(loop.server.m), m)


def test_fedswa_and_fedmoswa_defaults_are_the_released_codes():
    """The paper gives no ρ or γ; the defaults are the released code's (ρ = 0, γ = 0.4)."""
    swa, moswa = fedlight.create("fedswa"), fedlight.create("fedmoswa")
    assert swa.local.rho == 0.0 and moswa.local.rho == 0.0
    assert moswa.server.gamma == 0.4
