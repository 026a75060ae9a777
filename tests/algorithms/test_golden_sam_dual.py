"""Sharpness-aware rules with drift corrections: FedGAMMA, FedSMOO, FedSpeed, FedLESAM (-S, -D).

Golden tests: two rounds on the 3-client softmax regression (full batch, 64-true, no wd, no clip) equal an
independent numpy derivation of ALGORITHMS.md §2 to 1e-10, server state and per-client state included.
Partial participation (2 of 3 clients, seed 1: S_0 = {0, 1}, S_1 = {0, 2}) checks that per-client state
survives rounds where the client is absent and that server sums use 1/N.
"""

import fedtest
import numpy as np
import pytest
from fedtest import assert_params_close, grad, lin, linear_model, make_loop, mean, norm, problem, run_rounds, zeros

import fedlight
from fedlight.core.registry import get_algorithm
from fedlight.core.sampling import sample_clients
from fedlight.errors import ConfigError

K, LR, R = 2, 0.1, 2
N, S_SIZE, SEED = 3, 2, 1  # partial participation: seed 1 samples {0, 1} then {0, 2}


def run(name, partial=False, **kw):
    clients, theta = problem(num_clients=N)
    extra = {"clients_per_round": S_SIZE, "seed": SEED} if partial else {}
    loop = make_loop(fedlight.create(name, **kw), clients, linear_model(theta), local_steps=K, lr=LR, **extra)
    return run_rounds(loop, R), clients, theta, loop


def sampled(r, partial):
    return sample_clients(N, S_SIZE, SEED, r) if partial else list(range(N))


def unit(v, eps=0.0):
    n = norm(v)
    return zeros(v) if n == 0 else lin((1 / (n + eps), v))


def np_(p):
    return {k: v.detach().cpu().double().numpy() for k, v in p.items()}


def client_state(loop, i, key):
    return np_(loop.store.get(i, "cpu")[key])


def sam_grad(y, xi, yi, rho):
    """g' = ∇ℓ(y + ρ·g/(‖g‖ + 1e-12))."""
    e = lin((rho, unit(grad(y, xi, yi), eps=1e-12)))
    return grad(lin((1, y), (1, e)), xi, yi)


def sanity_partial():
    assert [sample_clients(N, S_SIZE, SEED, r) for r in range(R)] == [[0, 1], [0, 2]]


# ------------------------------------------------------------------------------------------------ FedGAMMA
def test_fedgamma_golden():
    sanity_partial()
    rho = 0.1
    got, clients, theta, loop = run("fedgamma", partial=True, rho=rho)
    c, ci = zeros(theta), [zeros(theta) for _ in range(N)]
    x = theta
    for r in range(R):
        deltas, dcs = [], []
        for i in sampled(r, True):
            xi, yi = clients[i]
            y = dict(x)
            for _ in range(K):
                d = lin((1, sam_grad(y, xi, yi, rho)), (1, c), (-1, ci[i]))  # d = g' + c − c_i
                y = lin((1, y), (-LR, d))
            delta = lin((1, y), (-1, x))
            ci_new = lin((1, ci[i]), (-1, c), (-1 / (K * LR), delta))  # c_i⁺ = c_i − c + (x − y)/(Kη)
            dcs.append(lin((1, ci_new), (-1, ci[i])))
            ci[i] = ci_new
            deltas.append(delta)
        x = lin((1, x), (1, mean(deltas)))
        c = lin((1, c), *[(1 / N, dc) for dc in dcs])  # c ← c + (1/N) Σ Δc_i
    assert_params_close(got, x)
    assert_params_close(np_(loop.server.c), c)
    for i in range(N):
        assert_params_close(client_state(loop, i, "c_i"), ci[i])
    assert norm(ci[1]) > 0 and norm(c) > 0


# ------------------------------------------------------------------------------------------------ FedSMOO
def test_fedsmoo_golden():
    sanity_partial()
    rho, lam = 0.1, 0.3
    got, clients, theta, loop = run("fedsmoo", partial=True, rho=rho, lam=lam)
    h, s = zeros(theta), zeros(theta)
    gL, mu = [zeros(theta) for _ in range(N)], [zeros(theta) for _ in range(N)]
    x = theta
    for r in range(R):
        ys, mus = [], []
        for i in sampled(r, True):
            xi, yi = clients[i]
            y = dict(x)
            for _ in range(K):
                g_hat = lin((1, grad(y, xi, yi)), (-1, mu[i]), (-1, s))  # ĝ = g − μ_i − s
                e = lin((rho, unit(g_hat, eps=1e-12)))  # e = ρ ĝ/‖ĝ‖
                mu[i] = lin((1, mu[i]), (1, e), (-1, s))  # μ_i ← μ_i + e − s
                gp = grad(lin((1, y), (1, e)), xi, yi)  # g' = ∇ℓ(y + e)
                d = lin((1, gp), (-1, gL[i]), (lam, y), (-lam, x))  # d = g' − ∇L_i + λ(y − x_r)
                y = lin((1, y), (-LR, d))
            gL[i] = lin((1, gL[i]), (-lam, y), (lam, x))  # ∇L_i ← ∇L_i − λ(y − x_r)
            ys.append(y)
            mus.append(mu[i])
        h = lin((1, h), *[(-lam / N, lin((1, y), (-1, x))) for y in ys])  # h ← h − λ/N Σ (y − x_r)
        x = lin((1, mean(ys)), (-1 / lam, h))  # x ← mean y − h/λ
        s = lin((rho, unit(mean(mus))))  # s ← ρ·mean(μ)/‖mean(μ)‖
    assert_params_close(got, x)
    assert_params_close(np_(loop.server.inner.h), h)
    assert_params_close(np_(loop.server.s), s)
    assert norm(s) == pytest.approx(rho)
    for i in range(N):
        assert_params_close(client_state(loop, i, "grad_L"), gL[i])
        assert_params_close(client_state(loop, i, "mu"), mu[i])
    # client 1 trained only in round 0: its duals are the round-0 values, untouched by round 1
    assert norm(mu[1]) > 0 and norm(gL[1]) > 0


# ------------------------------------------------------------------------------------------------ FedSpeed
def test_fedspeed_golden():
    rho, lam = 0.2, 0.3
    got, clients, theta, loop = run("fedspeed", rho=rho, lam=lam)
    h, gL = zeros(theta), [zeros(theta) for _ in range(N)]
    x = theta
    for r in range(R):
        ys = []
        for i in sampled(r, False):
            xi, yi = clients[i]
            y = dict(x)
            for _ in range(K):
                d = lin((1, sam_grad(y, xi, yi, rho)), (-1, gL[i]), (lam, y), (-lam, x))  # g' − ∇L_i + λ(y − x)
                y = lin((1, y), (-LR, d))
            gL[i] = lin((1, gL[i]), (-lam, y), (lam, x))
            ys.append(y)
        h = lin((1, h), *[(-lam / N, lin((1, y), (-1, x))) for y in ys])
        x = lin((1, mean(ys)), (-1 / lam, h))
    assert_params_close(got, x)
    assert_params_close(np_(loop.server.h), h)
    for i in range(N):
        assert_params_close(client_state(loop, i, "grad_L"), gL[i])


# ------------------------------------------------------------------------------------------------ FedLESAM
def lesam_reference(clients, theta, rho, partial, correction, server):
    """correction(i, y, x) -> drift term added to d (and its own bookkeeping via the server closure);
    server(x, ys, S) -> x_{r+1}. Returns x_R, the last move and the perturbations used per round."""
    x, move, es = theta, zeros(theta), []
    for r in range(R):
        e = lin((-rho, unit(move)))  # e = −ρ·(x_r − x_{r−1})/‖x_r − x_{r−1}‖, zero in round 0
        es.append(e)
        S = sampled(r, partial)
        ys = []
        for i in S:
            xi, yi = clients[i]
            y = dict(x)
            for _ in range(K):
                d = lin((1, grad(lin((1, y), (1, e)), xi, yi)), (1, correction(i, y, x)))  # d = ∇ℓ(y + e) + corr
                y = lin((1, y), (-LR, d))
            ys.append((i, y))
        x_new = server(x, ys)
        move = lin((1, x_new), (-1, x))  # Δ_G = x_{r+1} − x_r
        x = x_new
    return x, move, es


def test_fedlesam_golden():
    rho = 0.2
    got, clients, theta, loop = run("fedlesam", rho=rho)
    fedavg = lambda x, ys: mean([y for _, y in ys])  # noqa: E731
    x, move, es = lesam_reference(clients, theta, rho, False, lambda i, y, x: zeros(x), fedavg)
    assert_params_close(got, x)
    assert_params_close(np_(loop.server.move), move)
    # round 0 has no perturbation; round 1 perturbs by a vector of norm ρ along −(x_1 − x_0)
    assert norm(es[0]) == 0 and norm(es[1]) == pytest.approx(rho)
    assert loop.rows[0]["rule/perturbation_norm"] == 0
    assert loop.rows[1]["rule/perturbation_norm"] == pytest.approx(rho)
    # and the round-1 perturbation matters: without it the result is FedAvg's, measurably different
    x_avg, _, _ = lesam_reference(clients, theta, 0.0, False, lambda i, y, x: zeros(x), fedavg)
    assert max(np.abs(got[k] - x_avg[k]).max() for k in got) > 1e-4


def test_fedlesam_s_golden():
    sanity_partial()
    rho, lam = 0.2, 0.5
    got, clients, theta, loop = run("fedlesam_s", partial=True, rho=rho, lam=lam)
    st = {"c": zeros(theta), "ci": [zeros(theta) for _ in range(N)]}

    def correction(i, y, x):
        return lin((lam, st["c"]), (-lam, st["ci"][i]))  # λ_c(c − c_i)

    def server(x, ys):
        dcs, deltas = [], []
        for i, y in ys:
            delta = lin((1, y), (-1, x))
            ci_new = lin((1, st["ci"][i]), (-1, st["c"]), (-1 / (K * LR), delta))  # c_i⁺ (unscaled by λ_c)
            dcs.append(lin((1, ci_new), (-1, st["ci"][i])))
            st["ci"][i] = ci_new
            deltas.append(delta)
        st["c"] = lin((1, st["c"]), *[(1 / N, dc) for dc in dcs])
        return lin((1, x), (1, mean(deltas)))

    x, move, es = lesam_reference(clients, theta, rho, True, correction, server)
    assert_params_close(got, x)
    assert_params_close(np_(loop.server.move), move)
    assert_params_close(np_(loop.server.inner.c), st["c"])
    for i in range(N):
        assert_params_close(client_state(loop, i, "c_i"), st["ci"][i])
    assert norm(es[1]) == pytest.approx(rho)


def test_fedlesam_d_golden():
    sanity_partial()
    rho, alpha = 0.2, 0.3
    got, clients, theta, loop = run("fedlesam_d", partial=True, rho=rho, alpha=alpha)
    st = {"h": zeros(theta), "gL": [zeros(theta) for _ in range(N)]}

    def correction(i, y, x):
        return lin((-1, st["gL"][i]), (alpha, y), (-alpha, x))  # −∇L_i + α(y − x_r)

    def server(x, ys):
        for i, y in ys:
            st["gL"][i] = lin((1, st["gL"][i]), (-alpha, y), (alpha, x))
        st["h"] = lin((1, st["h"]), *[(-alpha / N, lin((1, y), (-1, x))) for _, y in ys])
        return lin((1, mean([y for _, y in ys])), (-1 / alpha, st["h"]))  # x ← mean y − h/α

    x, move, es = lesam_reference(clients, theta, rho, True, correction, server)
    assert_params_close(got, x)
    assert_params_close(np_(loop.server.move), move)  # the whole move, −h/α part included
    assert_params_close(np_(loop.server.inner.h), st["h"])
    for i in range(N):
        assert_params_close(client_state(loop, i, "grad_L"), st["gL"][i])
    assert norm(es[1]) == pytest.approx(rho)


# ------------------------------------------------------------------------------------------------ equivalences
@pytest.mark.parametrize("name,kw,base,base_kw", [
    ("fedgamma", {"rho": 0.0}, "scaffold", {}),
    ("fedlesam", {"rho": 0.0}, "fedavg", {}),
    ("fedlesam_s", {"rho": 0.0, "lam": 1.0}, "scaffold", {}),
    ("fedlesam_d", {"rho": 0.0, "alpha": 0.2}, "feddyn", {"alpha": 0.2}),
    ("fedspeed", {"rho": 0.0, "lam": 0.2}, "feddyn", {"alpha": 0.2}),
    ("fedsmoo", {"rho": 0.0, "lam": 0.2}, "feddyn", {"alpha": 0.2}),
])
def test_rho_zero_reduces_bitwise(name, kw, base, base_kw):
    """32-true, minibatches, weight decay, an active clip and partial participation: still bit-identical."""
    clients, theta = problem(num_clients=N)
    common = dict(local_steps=K, lr=LR, precision="32-true", batch_size=2, weight_decay=1e-3, max_grad_norm=0.5,
                  clients_per_round=S_SIZE, seed=SEED)
    want = run_rounds(make_loop(fedlight.create(base, **base_kw), clients, linear_model(theta), **common), R)
    got = run_rounds(make_loop(fedlight.create(name, **kw), clients, linear_model(theta), **common), R)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{name} {kw} != {base} at {k}")


def test_fedlesam_round0_is_fedavg_round1_is_not():
    """With ρ > 0 FedLESAM equals FedAvg in round 0 (no global move yet) and departs from it in round 1."""
    clients, theta = problem(num_clients=N)
    loops = {n: make_loop(fedlight.create(n, **kw), clients, linear_model(theta), local_steps=K, lr=LR)
             for n, kw in (("fedavg", {}), ("fedlesam", {"rho": 0.3}))}
    x1 = {n: run_rounds(lp, 1) for n, lp in loops.items()}
    for k in x1["fedavg"]:
        np.testing.assert_array_equal(x1["fedlesam"][k], x1["fedavg"][k])
    for lp in loops.values():
        lp.run_round(1)
    assert max(float((loops["fedlesam"].x[k] - loops["fedavg"].x[k]).abs().max()) for k in theta) > 1e-4


# ------------------------------------------------------------------------------------------------ contract
NAMES = ["fedgamma", "fedsmoo", "fedspeed", "fedlesam", "fedlesam_s", "fedlesam_d"]
SPECS = {"fedgamma": (2, (2, 2), True), "fedsmoo": (2, (2, 2), True), "fedspeed": (2, (1, 1), True),
         "fedlesam": (1, (2, 1), False), "fedlesam_s": (1, (3, 2), True), "fedlesam_d": (1, (2, 1), True)}


@pytest.mark.parametrize("name", NAMES)
def test_registry_comm_and_backprops_match_what_runs(name):
    spec = get_algorithm(name)
    assert (spec.backprops, spec.comm, spec.stateful_clients) == SPECS[name]
    clients, theta = problem(num_clients=N)
    model = linear_model(theta)
    forwards = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    loop = make_loop(fedlight.create(name), clients, model, local_steps=K, lr=LR, clients_per_round=S_SIZE, seed=SEED)
    row = loop.run_round(0)
    vec = sum(v.numel() * v.element_size() for v in loop.x.values())
    assert row["bytes_down"] == spec.comm[0] * vec * S_SIZE
    assert row["bytes_up"] == spec.comm[1] * vec * S_SIZE
    assert len(forwards) == spec.backprops * K * S_SIZE
    # SAM-style perturbations take ‖g‖ (16-mixed refused); LESAM's is the norm of a parameter difference
    assert loop.local.needs_true_grad_norm == (not name.startswith("fedlesam"))


@pytest.mark.parametrize("name", ["fedsmoo", "fedlesam_s"])
def test_resume_is_bitwise(name, tmp_path):
    """Server state (wrapped: s/move around h/c) and client duals survive a weights_only checkpoint."""
    clients, theta = problem(num_clients=N)
    opts = dict(local_steps=K, lr=LR, precision="32-true", clients_per_round=S_SIZE, seed=SEED)
    full = make_loop(fedlight.create(name), clients, linear_model(theta), out_dir=tmp_path / "a", **opts)
    want = run_rounds(full, R)
    first = make_loop(fedlight.create(name), clients, linear_model(theta), out_dir=tmp_path / "b", **opts)
    run_rounds(first, 1)
    fedtest.save_checkpoint(first, first.out_dir)
    resumed = make_loop(fedlight.create(name), clients, linear_model(theta), out_dir=tmp_path / "c", **opts)
    fedtest.resume(resumed, tmp_path / "b" / "checkpoints" / "last.ckpt")
    resumed.run_round(1)
    for k in want:
        np.testing.assert_array_equal(resumed.x[k].numpy(), want[k])


@pytest.mark.parametrize("name,kw,arg", [
    ("fedgamma", {"rho": -0.1}, "rho"), ("fedgamma", {"server_lr": 0.0}, "server_lr"),
    ("fedsmoo", {"rho": -1.0}, "rho"), ("fedsmoo", {"lam": 0.0}, "lam"),
    ("fedspeed", {"rho": -1.0}, "rho"), ("fedspeed", {"lam": -0.1}, "lam"),
    ("fedlesam", {"rho": -0.1}, "rho"), ("fedlesam", {"server_lr": -1.0}, "server_lr"),
    ("fedlesam_s", {"rho": -0.1}, "rho"), ("fedlesam_s", {"lam": -0.1}, "lam"),
    ("fedlesam_s", {"server_lr": 0.0}, "server_lr"),
    ("fedlesam_d", {"rho": -0.1}, "rho"), ("fedlesam_d", {"alpha": 0.0}, "alpha"),
])
def test_argument_validation(name, kw, arg):
    with pytest.raises(ConfigError, match=rf"`algorithm\.{arg}` must be"):
        fedlight.create(name, **kw)
